"""C2 on the CPU: how the CUDA backend cleans up after a failed capture, with the allocator calls
recorded instead of made. tests/backends/test_cuda.py checks the same on a GPU."""

from __future__ import annotations

import pytest
import torch

from graphcap.backends.pool import discard_capture

DEVICE, HANDLE = torch.device("cuda", 3), (0, 7)


class _Graph:
    """A torch.cuda.CUDAGraph after a failure: `pool()` works only after a completed capture_end."""

    def __init__(self, calls: list, *, ended: bool) -> None:
        self.calls, self.ended = calls, ended

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return HANDLE

    def reset(self) -> None:
        self.calls.append("reset")  # releases the pool's use only after a completed capture


class _Calls(list):
    recording = True  # whether the allocator is still recording to the pool


@pytest.fixture
def calls(monkeypatch) -> _Calls:
    calls = _Calls()

    def end(device: int, pool: tuple) -> None:
        calls.append(("end", device, pool))
        if not calls.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: calls.append(("release", device, pool)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    return calls


def test_an_invalidated_capture_stops_recording_to_the_pool_and_releases_its_use(calls):
    # capture_end threw at cudaStreamEndCapture, before it ended the allocator's recording.
    discard_capture(_Graph(calls, ended=False), DEVICE, HANDLE)
    assert calls == ["reset", ("end", 3, HANDLE), ("release", 3, HANDLE), "synchronize", "empty_cache"]


def test_a_completed_capture_is_left_to_reset(calls):
    # The forward raised, capture_end completed: reset() releases the pool, nothing else may.
    discard_capture(_Graph(calls, ended=True), DEVICE, HANDLE)
    assert calls == ["reset", "synchronize", "empty_cache"]


def test_a_pool_that_was_not_recording_is_never_released(calls):
    # capture_begin failed early, or capture_end failed after ending the recording: releasing
    # here could drop the pool's count to zero under graphs still alive in it.
    calls.recording = False
    discard_capture(_Graph(calls, ended=False), DEVICE, HANDLE)
    assert calls == ["reset", ("end", 3, HANDLE), "synchronize", "empty_cache"]
