"""After a failed CUDA capture, on the CPU (tests/backends/simulated_cuda.py, torch 2.11's order): a capture
CUDA invalidated leaves the generators out of capture mode, a refused host-device copy and CUDA's errors
900-907 get graphcap's hint, and the budget reservation empties the allocator's cache before its holder
captures. tools/gpu_check.py checks the same on a GPU (P13, P10)."""

from __future__ import annotations

import sys

import pytest
import torch

from graphcap.backends import cuda as cuda_backend
from graphcap.backends.cuda import CUDAGraphBackend
from graphcap.backends.cuda_recovery import COPY_REFUSED, INVALIDATED, capture_failure
from graphcap.errors import CaptureError
from tests.backends.fake_allocator import FakeCUDAGraph
from tests.backends.simulated_cuda import CUDA0, SimulatedCUDA

MiB = 1 << 20
SYNC_REFUSED = "CUDA error: operation not permitted when stream is capturing"  # error 900


class CUDAGenerator(torch.Generator):
    """Stands in for `torch.Generator("cuda")`, which a CPU-only torch cannot make."""

    @property
    def device(self) -> torch.device:
        return CUDA0


def _syncing(cuda: SimulatedCUDA, x: torch.Tensor):
    """A forward that syncs during capture (`torch.cuda.synchronize()`): CUDA refuses it and invalidates the capture."""

    def forward():
        x * 2
        cuda.graphs[-1].invalidated = True
        raise RuntimeError(SYNC_REFUSED)

    return forward


def test_after_a_capture_cuda_invalidated_every_generator_draws_again(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    sampler = CUDAGenerator()
    backend = cuda.backend(generators=[sampler])
    x = torch.ones(4)
    with pytest.raises(CaptureError, match=r"CUDA invalidated the capture of bad: .*\(CUDA error: operation not"):
        backend.capture(_syncing(cuda, x), {"x": x}, name="bad")
    cuda.allocator.draw()  # the device's default generator
    cuda.allocator.draw(sampler)  # and the registered one: no "Offset increment outside graph capture"
    failed, restore = cuda.graphs[-2:]
    assert restore.completed is False and restore.generators == ["default", sampler]  # registered, then reset
    assert restore.handle != failed.handle and cuda.allocator.use_count.get(restore.handle, 0) == 0
    graph = backend.capture(lambda: x * 3, {"x": x}, name="good")  # later captures work
    assert graph.name == "good"


def test_without_the_restore_torch_2_11_leaves_the_generators_in_capture_mode(monkeypatch):
    # The canary: what an engine's eager sampling meets after such a capture without graphcap's restore.
    cuda = SimulatedCUDA(monkeypatch)
    sampler = CUDAGenerator()
    backend = cuda.backend(generators=[sampler])
    monkeypatch.setattr(CUDAGraphBackend, "restore_generators", lambda self, error=None: None)
    x = torch.ones(4)
    with pytest.raises(CaptureError, match="CUDA invalidated"):
        backend.capture(_syncing(cuda, x), {"x": x}, name="bad")
    for generator in ("default", sampler):
        with pytest.raises(RuntimeError, match="Offset increment outside graph capture encountered unexpectedly"):
            cuda.allocator.draw(generator)


def test_a_capture_that_ended_cleanly_needs_no_restore(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    x = torch.ones(4)

    def broken():
        x * 2
        raise RuntimeError("model bug")  # capture_end completes: the generators left capture mode there

    with pytest.raises(RuntimeError, match="model bug"):
        backend.capture(broken, {"x": x}, name="bad")
    assert len(cuda.begins()) == 1 and not cuda.allocator.capturing_generators


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came with Python 3.11")
def test_a_restore_cuda_refuses_leaves_the_captures_error_with_a_note(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()

    def sticky(*args) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cuda_backend, "restore_generators", sticky)
    x = torch.ones(4)
    with pytest.raises(CaptureError, match="CUDA invalidated") as caught:
        backend.capture(_syncing(cuda, x), {"x": x}, name="bad")
    (note,) = caught.value.__cause__.__notes__  # on the forward's own error, which the CaptureError keeps
    assert note == (
        "graphcap could not take the CUDA generators out of capture mode: "
        "CUDA error: an illegal memory access was encountered"
    )


def test_a_refused_host_device_copy_gets_the_staging_hint_and_needs_no_restore(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    x = torch.ones(4)

    def upload():
        x * 2  # torch refuses the copy before CUDA sees it: the capture itself ends cleanly
        raise RuntimeError(f"{COPY_REFUSED} unless the CPU tensor is pinned. Please use tensor.pin_memory()")

    with pytest.raises(
        CaptureError, match=r"torch refused a host-device copy during the capture of up \(Cannot copy .*pinned tensor"
    ):
        backend.capture(upload, {"x": x}, name="up")
    assert len(cuda.begins()) == 1 and not cuda.allocator.capturing_generators


@pytest.mark.parametrize("text", INVALIDATED, ids=[f"error {900 + i}" for i in range(len(INVALIDATED))])
def test_cudas_capture_errors_900_to_907_get_the_invalidated_capture_hint(text):
    error = capture_failure("k", RuntimeError(f"CUDA error: {text}\nCompile with `TORCH_USE_CUDA_DSA`"))
    assert str(error).startswith("CUDA invalidated the capture of k: the forward called something a CUDA graph cannot")
    assert f"(CUDA error: {text})" in str(error) and "a side stream forked and not joined back" in str(error)
    assert capture_failure("k", RuntimeError("CUDA error: out of memory")) is None  # not a capture error


def test_the_reservation_empties_the_cache_before_its_holder_captures(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    cached = {"bytes": 300 * MiB}  # freed blocks the allocator keeps: free device memory is below the budget
    real_empty_cache, real_empty = torch.cuda.empty_cache, torch.empty

    def empty_cache() -> None:
        cached["bytes"] = 0
        real_empty_cache()

    def empty(*size, dtype=None, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda" and size[0] > MiB and cached["bytes"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 252.00 MiB (300 MiB cached)")
        return real_empty(*size, dtype=dtype, device=device, **kwargs)

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch, "empty", empty)
    assert backend.reserve(256 * MiB) == 256 * MiB
    calls = cuda.allocator.calls
    begin = calls.index(next(c for c in calls if c[0:1] == ("capture_begin",)))
    assert "host_empty_cache" in calls[:begin]  # the pinned host cache too, as before every capture


def test_a_reservation_whose_holder_capture_cuda_invalidated_leaves_the_generators_drawing(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    real_end, ends = FakeCUDAGraph.capture_end, []

    def first_one_invalidated(self, invalidated: bool = False) -> None:
        ends.append(self)
        real_end(self, invalidated=len(ends) == 1)

    monkeypatch.setattr(FakeCUDAGraph, "capture_end", first_one_invalidated)
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        backend.reserve(64 * MiB)
    cuda.allocator.draw()  # the restore's empty capture ended the default generator's capture mode
    assert len(ends) == 2 and backend.reserved_bytes is None
