"""`Communicator` hooks around a capture pass: begin, each captured key, end, then verification."""

from __future__ import annotations

import contextlib

import pytest

import graphcap
from graphcap import CaptureError, CaptureManager, Communicator
from graphcap.testing import make_config
from tests.test_phases import PhaseModel


class Logged(Communicator):
    def __init__(self, log: list) -> None:
        self.log = log

    def capture_begin(self) -> None:
        self.log.append(("begin", graphcap.phase()))

    def key_captured(self, key) -> None:
        self.log.append(("key", key))

    def capture_end(self) -> None:
        self.log.append(("end", graphcap.phase()))


class LoggedModel(PhaseModel):
    """Logs its verification forwards in the same list as the hooks; fails its recording of `fail_size`."""

    def __init__(self, log: list, fail_size: int | None = None) -> None:
        super().__init__()
        self.log, self.fail_size = log, fail_size

    def forward(self, inputs):
        if graphcap.phase() == "verify":
            self.log.append(("verify", inputs.key))
        if graphcap.is_capturing() and inputs.key.num_tokens == self.fail_size:
            raise RuntimeError("injected failure")
        return super().forward(inputs)


def _manager(log: list, on_error: str = "skip", fail_size: int | None = None) -> CaptureManager:
    @contextlib.contextmanager
    def graph_capture():
        log.append(("enter", None))
        try:
            yield
        finally:
            log.append(("exit", None))

    return CaptureManager(
        LoggedModel(log, fail_size),
        make_config(capture__on_error=on_error),
        backend="emulated",
        progress=False,
        capture_context=graph_capture,
        communicators=[Logged(log)],
    )


def test_hooks_run_inside_the_capture_context_in_capture_order_before_verification():
    log: list = []
    manager = _manager(log)
    manager.capture()
    order = manager.registry.capture_order()
    kinds = [kind for kind, _ in log]
    assert kinds[:2] == ["enter", "begin"] and log[1] == ("begin", "capture")
    assert [value for kind, value in log if kind == "key"] == order
    end = kinds.index("end")
    assert kinds[end : end + 2] == ["end", "exit"] and log[end] == ("end", "capture")
    assert kinds.index("verify") > end + 1  # verification replays read registered buffers
    assert kinds.count("begin") == kinds.count("end") == 1


def test_a_key_that_failed_to_capture_is_not_registered():
    log: list = []
    manager = _manager(log, fail_size=4)
    manager.capture()
    registered = {value for kind, value in log if kind == "key"}
    assert registered == set(manager.graphs) and all(key.num_tokens != 4 for key in registered)


def test_a_failed_pass_still_ends_the_communicators_capture():
    log: list = []
    manager = _manager(log, on_error="raise", fail_size=4)
    with pytest.raises(CaptureError, match="injected failure"):
        manager.capture()
    kinds = [kind for kind, _ in log]
    assert kinds[-2:] == ["end", "exit"] and "verify" not in kinds


def test_communicators_must_be_communicator_instances():
    config = make_config()
    with pytest.raises(TypeError, match=r"communicators\[0\] is a object; subclass graphcap\.Communicator"):
        CaptureManager(PhaseModel(), config, backend="emulated", communicators=[object()])
    with pytest.raises(TypeError, match=r"communicators must be a list of graphcap\.Communicator; got Logged"):
        CaptureManager(PhaseModel(), config, backend="emulated", communicators=Logged([]))
