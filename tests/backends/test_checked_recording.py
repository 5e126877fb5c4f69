"""The emulated backend's recording runs every check of the preflight (`checks_in_capture`), so a capture pass
warms a full graph's key up without a separate checked run: the same ops are refused with the same errors,
from the recording, and a backend whose capture does not check keeps its preflight."""

from __future__ import annotations

import contextlib

import pytest
import torch

import graphcap.backends.emulated as emulated_module
from graphcap import CaptureError, CaptureManager, CaptureUnsafeError
from graphcap.backends import check_capture_safe
from graphcap.backends import generators as generators_module
from graphcap.backends import preflight as preflight_module
from graphcap.backends.preflight import in_preflight
from graphcap.capture.recorder import Recorder
from graphcap.models import build_model
from graphcap.phases import phase
from graphcap.testing import Wrapped, make_config


class HostRead(Wrapped):
    """The reference model scaled by a value read into Python: refused by the checker, fine eagerly."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__(inner)
        self.phases: list[str] = []

    def forward(self, inputs) -> torch.Tensor:
        self.phases.append(phase())
        scale = inputs.input_ids.float().mean().item()  # unsafe
        return self.inner(inputs) * scale


def _manager(on_error: str = "raise") -> CaptureManager:
    config = make_config({"capture.sizes": [2, 4], "capture.on_error": on_error})
    return CaptureManager(HostRead(build_model(config)), config, backend="emulated", progress=False)


def test_an_unsafe_op_is_refused_by_the_recording_with_the_preflight_s_error():
    manager = _manager()
    with pytest.raises(CaptureUnsafeError) as caught:
        manager.capture()
    assert manager.model.phases == ["warmup", "capture"]  # one plain warmup, then the checked recording
    assert manager.graphs == {}
    # The preflight (check_capture_safe runs it) names the same op at the same line with the same words.
    inner, inputs = manager.model, manager.buffers.stage(Recorder(manager.capturer.parts).capture_batch(
        manager.registry.capture_order()[0]), manager.registry.capture_order()[0])  # fmt: skip
    with pytest.raises(CaptureUnsafeError) as preflight:
        check_capture_safe(lambda: inner(inputs), "cpu")
    assert str(caught.value).endswith(str(preflight.value))
    assert caught.value.op == preflight.value.op == "Tensor.item"
    assert caught.value.location == preflight.value.location


def test_under_skip_every_key_is_skipped_with_the_op_named():
    report = _manager("skip").capture()
    assert report.records and all(r.status == "skipped" and "Tensor.item at " in r.reason for r in report.records)


def test_canary_without_the_recording_s_checks_the_op_is_recorded_frozen(monkeypatch):
    """What the recording's checks guard: with them gone (and no preflight), the host read is frozen into the
    graph, and only verification's probes catch it, as a frozen value, never naming the op or its line."""
    monkeypatch.setattr(emulated_module, "unsafe_op_checker", lambda device, mode: mode)  # no function mode
    monkeypatch.setattr(preflight_module, "check_op", lambda *args: None)  # the recorder checks no aten op
    manager = _manager()
    with pytest.raises(CaptureError, match="froze a host value at capture") as caught:
        manager.capture()
    assert not isinstance(caught.value, CaptureUnsafeError) and "test_checked_recording.py" not in str(caught.value)
    assert manager.model.phases[:2] == ["warmup", "capture"]


def test_a_backend_whose_capture_does_not_check_keeps_its_preflight(emulated):
    calls = []

    def forward():
        calls.append(torch._C._len_torch_dispatch_stack())  # the checker is a dispatch mode
        return torch.ones(1)

    emulated.warmup(forward, num_warmups=1, checked=False)
    assert calls == [0]  # the plain warmup alone
    emulated.checks_in_capture = False
    with pytest.raises(ValueError, match=r"warmup\(checked=False\) on the emulated backend: its capture does not"):
        emulated.warmup(forward, num_warmups=1, checked=False)
    assert calls == [0]


def test_the_recording_knows_the_backend_s_generators_as_its_preflight_does(emulated):
    sampler = torch.Generator()
    emulated.add_generators([sampler])
    seen = []

    def forward():
        seen.append(generators_module._REGISTERED.get())
        return torch.ones(1) * 2

    emulated.warmup(forward, num_warmups=0)  # the preflight alone
    emulated.capture(forward, {}, name="key")
    assert len(seen) == 2 and all(len(known) == 1 and known[0] is sampler for known in seen)


def test_a_piecewise_key_keeps_its_checked_preflight(monkeypatch):
    """Piecewise keys are checked in their warmup (request-metadata reads are refused only there)."""
    entered = []
    preflight = emulated_module.GraphBackend.warmup.__globals__["preflight"]

    @contextlib.contextmanager
    def counted(*args, **kwargs):
        entered.append(phase())
        with preflight(*args, **kwargs) as uncompiled:
            yield uncompiled

    monkeypatch.setitem(emulated_module.GraphBackend.warmup.__globals__, "preflight", counted)
    config = make_config({"capture.sizes": [2, 4], "capture.mode": "piecewise", "model.attention": "per_request"})
    manager = CaptureManager(build_model(config), config, backend="emulated", progress=False)
    report = manager.capture()
    assert all(r.status == "captured" and r.verified for r in report.records)
    assert entered == ["warmup"] * len(report.records)


class Phases(Wrapped):
    """The reference model, noting each forward's phase and whether it ran under the preflight."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__(inner)
        self.runs: list[tuple[str, bool]] = []

    def forward(self, inputs) -> torch.Tensor:
        self.runs.append((phase(), in_preflight()))
        return self.inner(inputs)


@pytest.mark.parametrize("num_warmups", [0, 1, 2])
def test_the_recording_is_never_a_key_s_first_run(num_warmups):
    """With no plain warmup the preflight still runs (lazy initialisation happens before the recording)."""
    config = make_config({"capture.sizes": [4], "capture.num_warmups": num_warmups})
    model = Phases(build_model(config))
    report = CaptureManager(model, config, backend="emulated", progress=False).capture()
    assert report.records and all(r.verified for r in report.records)
    first_key = model.runs[: model.runs.index(("capture", False)) + 1]
    expected = [("warmup", True)] if num_warmups == 0 else [("warmup", False)] * num_warmups
    assert first_key == [*expected, ("capture", False)]
