"""A stand-in for the CUDA caching allocator's pool bookkeeping, with PyTorch's own rules, for CPU tests.

PyTorch (c10/cuda/CUDACachingAllocator.cpp) keeps a use count per graph pool:
`beginAllocateToPool` creates the pool or increments its count (and asserts the count is above
zero when the pool exists: `TORCH_INTERNAL_ASSERT(use_count > 0)`), `endAllocateToPool` stops
recording (and raises when nothing records to that pool), `releasePool` decrements it (asserting
it stays >= 0), and a pool whose count reached zero stays known until `empty_cache()` frees it.
`FakeCUDAGraph` plays `torch.cuda.CUDAGraph` against it in the order a given torch version ends a
failed capture, CUDA generators included (at::cuda::CUDAGraph, torch 2.11): `capture_begin` puts the
default generator and every registered one in capture mode (`capture_prologue`), `capture_end` takes
them out (`capture_epilogue`) only after `cudaStreamEndCapture` succeeded, and an eager draw from a
generator in capture mode raises (`draw`).
"""

from __future__ import annotations

import pytest
import torch


class InternalAssert(RuntimeError):
    """What TORCH_INTERNAL_ASSERT raises into Python."""


class FakeAllocator:
    def __init__(self) -> None:
        self.use_count: dict = {}
        self.recording: set = set()
        self.calls: list = []
        self.capturing_generators: list = []  # generators in capture mode ("default": the device's own)

    def draw(self, generator="default") -> None:
        """An eager random draw from `generator` (torch 2.11's CUDAGeneratorState::increase, no capture under way)."""
        if any(generator is g for g in self.capturing_generators):
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")

    def begin(self, device: int, handle) -> None:
        self.calls.append(("begin", handle))
        if handle in self.use_count and self.use_count[handle] <= 0:
            raise InternalAssert("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        self.use_count[handle] = self.use_count.get(handle, 0) + 1
        self.recording.add(handle)

    def end(self, device: int, handle) -> None:
        self.calls.append(("end", handle))
        if handle not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.discard(handle)

    def release(self, device: int, handle) -> None:
        self.calls.append(("release", handle))
        self.use_count[handle] -= 1
        if self.use_count[handle] < 0:
            raise InternalAssert("uc >= 0 INTERNAL ASSERT FAILED")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        for handle in [h for h, n in self.use_count.items() if n == 0]:
            del self.use_count[handle]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", self.end)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", self.release)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        return self


ORDERS = {
    "torch<=2.11": ((2, 11), "raise_before_end", False),
    "torch 2.12-2.13": ((2, 13), "end_then_raise", False),
    "reset releases (PR 190348)": ((2, 14), "end_then_raise", True),
}
"""How each torch ends a capture CUDA invalidated: (release, capture_end's order, whether `reset()`
releases a failed capture's pool)."""


class FakeCUDAGraph:
    """`torch.cuda.CUDAGraph` against a `FakeAllocator`, ending a failed capture in a version's order."""

    def __init__(self, allocator: FakeAllocator, order: str = "raise_before_end", reset_releases: bool = False):
        self.allocator, self.order, self.reset_releases = allocator, order, reset_releases
        self.handle = None
        self.began = False  # the pool's use was taken (beginAllocateToPool ran)
        self.completed = False
        self.invalidated = False  # set by a test: CUDA invalidated the capture under way
        self.replays = 0
        self.generators: list = ["default"]  # torch registers the device's default generator itself

    def register_generator_state(self, generator) -> None:
        self.allocator.calls.append(("register_generator_state", generator))
        self.generators.append(generator)

    def capture_begin(self, pool, capture_error_mode: str = "global", fail_after_recording: bool = False) -> None:
        self.handle = pool
        self.allocator.calls.append(("capture_begin", pool, capture_error_mode))
        self.allocator.begin(0, pool)
        self.began = True
        self.allocator.capturing_generators += [
            g for g in self.generators if g not in self.allocator.capturing_generators
        ]
        if fail_after_recording:  # cudaStreamBeginCapture failed after the allocator began recording
            raise RuntimeError("CUDA error: operation not permitted")

    def capture_end(self, invalidated: bool = False) -> None:
        invalidated = invalidated or self.invalidated
        if invalidated and self.order == "raise_before_end":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.allocator.end(0, self.handle)
        if invalidated:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.allocator.capturing_generators = [
            g for g in self.allocator.capturing_generators if not any(g is mine for mine in self.generators)
        ]  # capture_epilogue: after cudaStreamEndCapture succeeded
        self.completed = True

    def replay(self) -> None:
        self.replays += 1

    def pool(self):
        if not self.completed:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.handle

    def reset(self) -> None:
        self.allocator.calls.append("reset")
        if self.completed or (self.reset_releases and self.began):
            self.allocator.release(0, self.handle)
        self.completed = self.began = False
