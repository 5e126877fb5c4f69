"""torch's CPU threads during an emulated capture pass: `capture.num_threads` (null: 1), restored after.

The rules: every forward of an emulated pass (upfront, or a lazy key) runs on the threads the config
names (null: `EMULATED_CAPTURE_THREADS`); torch's setting comes back after the pass, on every exit path;
a bad count is refused naming the key.
"""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureError, ConfigError
from graphcap.capture.capturer import EMULATED_CAPTURE_THREADS
from graphcap.testing import make_config, make_manager


@pytest.fixture
def two_threads():
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(was)


def _seen_threads(manager) -> list[int]:
    seen: list[int] = []
    forward = manager._forward
    manager._forward = lambda inputs: seen.append(torch.get_num_threads()) or forward(inputs)
    return seen


@pytest.mark.parametrize(("num_threads", "expected"), [(None, EMULATED_CAPTURE_THREADS), (3, 3)])
def test_an_emulated_pass_runs_on_the_configured_threads_and_restores_torchs(two_threads, num_threads, expected):
    manager = make_manager(make_config(capture__num_threads=num_threads))
    torch.set_num_threads(2)  # the engine's setting is 2 here
    seen = _seen_threads(manager)
    manager.capture()
    assert seen and set(seen) == {expected}
    assert torch.get_num_threads() == 2


def test_a_lazy_key_runs_on_the_capture_threads(two_threads):
    manager = make_manager(make_config(capture__strategy="lazy"))
    torch.set_num_threads(2)
    seen = _seen_threads(manager)
    assert manager.capture_pending(max_keys=1) == 1
    assert set(seen) == {EMULATED_CAPTURE_THREADS} and torch.get_num_threads() == 2


def test_threads_are_restored_when_a_pass_fails(two_threads):
    manager = make_manager(make_config())
    torch.set_num_threads(2)
    forward = manager._forward

    def failing(inputs):
        forward(inputs)
        raise RuntimeError("injected fault")

    manager._forward = failing
    with pytest.raises(CaptureError, match="injected fault"):
        manager.capture()
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_a_bad_thread_count_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"capture.num_threads"):
        make_config(capture__num_threads=bad)
