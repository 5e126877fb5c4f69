"""A manager on a backend with the CUDA allocator's pool accounting and sync-debug mode simulated, on the CPU:
the memory-budget reservation follows the pool through a failed key and goes back on `release()` of a
passed-in backend, managers sharing a pool reserve once, every lazy key's capture starts from an emptied
cache, and the process-wide sync-debug mode stays off while `capture_pending` runs beside an engine's
threads unless `checks.sync_debug` asks for it. tests/backends/test_cuda.py shows the same on a GPU."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import graphcap
from graphcap import CaptureError, CaptureManager
from graphcap.backends import GraphPool
from graphcap.models import build_model
from graphcap.testing import make_config
from tests.backends.fake_allocator import FakeAllocator
from tests.backends.test_cuda_simulated import FakeCUDABackend

BUDGET = 1 << 30


class ReservingBackend(FakeCUDABackend):
    """`FakeCUDABackend` whose pool reserves as the CUDA backend's does (a holder's use of the handle) and
    whose `empty_cache` is the allocator's."""

    def _new_pool(self) -> GraphPool:
        handles = itertools.count(1)
        return GraphPool(
            self.device, lambda: (0, next(handles)), empty_cache=self.allocator.empty_cache, reserve=self._hold
        )

    def _hold(self, handle, num_bytes: int):
        self.allocator.begin(0, handle)  # the empty holder graph's capture
        self.allocator.end(0, handle)
        self.allocator.calls.append(("reserve", handle, num_bytes))
        return (lambda: self.allocator.release(0, handle)), num_bytes

    def empty_cache(self) -> None:
        self.allocator.empty_cache()


class FailsOnce(torch.nn.Module):
    """The reference model, whose first capture (of the largest key) raises."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.failed = inner, False

    def forward(self, inputs):
        if graphcap.is_capturing() and not self.failed:
            self.failed = True
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner(inputs)


def _manager(backend, *, model=None, **overrides) -> CaptureManager:
    config = make_config({"capture.sizes": [1, 2, 4], "capture.memory_budget": BUDGET, **overrides})
    return CaptureManager(model or build_model(config), config, backend=backend, progress=False)


def _capture_handles(allocator: FakeAllocator) -> list:
    """The handle of each capture (not a reservation's holder)."""
    calls = allocator.calls
    holders = {i - 2 for i, call in enumerate(calls) if call[0:1] == ("reserve",)}
    return [call[1] for i, call in enumerate(calls) if call[0:1] == ("begin",) and i not in holders]


def test_after_a_failed_key_the_rest_of_the_pass_captures_inside_the_reservation():
    allocator = FakeAllocator()
    backend = ReservingBackend(allocator)
    inner = build_model(make_config({"capture.sizes": [1, 2, 4]}))
    manager = _manager(backend, model=FailsOnce(inner), **{"capture.on_error": "skip"})
    report = manager.capture()
    assert len(report.skipped) == 1 and len(report.captured) == len(report.records) - 1
    pool = backend.pool
    assert pool.reservation.handle == pool.handle and backend.reserved_bytes == BUDGET
    first, *later = _capture_handles(allocator)
    assert first != pool.handle and later == [pool.handle] * len(later)  # the failed one, then the reservation's
    assert first not in allocator.use_count  # the old handle: holder given back, pool freed
    assert report.memory_budget["reserved_bytes"] == BUDGET


def test_release_of_a_passed_in_backend_gives_the_reservation_back():
    allocator = FakeAllocator()
    backend = ReservingBackend(allocator)
    manager = _manager(backend)
    manager.capture()
    handle = backend.pool.handle
    assert allocator.use_count[handle] == 1 + len(manager.graphs)  # the holder and each graph
    manager.release()
    assert backend.reserved_bytes is None and handle not in allocator.use_count  # the memory went back
    manager.capture()  # and is reserved again, in the fresh pool
    assert backend.pool.reservation.handle == backend.pool.handle != handle


def test_managers_sharing_one_backend_reserve_the_budget_once():
    allocator = FakeAllocator()
    backend = ReservingBackend(allocator)
    one, two = _manager(backend), _manager(backend)
    one.capture()
    two.capture()
    reservations = [call for call in allocator.calls if call[0:1] == ("reserve",)]
    assert len(reservations) == 1 and backend.reserved_bytes == BUDGET


def test_each_lazy_key_is_captured_after_the_cache_was_emptied():
    allocator = FakeAllocator()
    backend = ReservingBackend(allocator)
    manager = _manager(backend, **{"capture.strategy": "lazy"})
    manager.capture()
    allocator.calls.clear()
    assert manager.capture_pending(max_keys=2) == 2
    assert manager.capture_pending() == len(manager.registry.planned) - 2
    calls = allocator.calls
    begins = [i for i, call in enumerate(calls) if call[0:1] == ("begin",)]
    assert len(begins) == len(manager.registry.planned)
    for before, at in zip([-1, *begins], begins, strict=False):
        assert "empty_cache" in calls[before + 1 : at], f"capture {calls[at]} without an emptied cache"


@pytest.fixture
def sync_debug(monkeypatch) -> SimpleNamespace:
    """torch.cuda's sync-debug mode, recorded: every value it was set to."""
    state = SimpleNamespace(mode=0, history=[])

    def set_mode(value) -> None:
        state.mode = {"default": 0, "warn": 1, "error": 2}.get(value, value)
        state.history.append(state.mode)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: state.mode)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    return state


def test_capture_pending_leaves_the_process_wide_sync_debug_mode_off(sync_debug):
    backend = ReservingBackend(FakeAllocator())
    backend._preflight_syncs = True  # as on CUDA: the preflight turns the mode on
    manager = _manager(backend, **{"capture.strategy": "lazy"})
    manager.capture()
    assert manager.capture_pending() == len(manager.registry.planned)
    assert sync_debug.history == []  # another engine thread's .item() could not have raised
    manager.release()
    upfront = _manager(backend)  # capture() before the engine serves: the preflight's full check
    upfront.capture()
    assert sync_debug.history.count(2) == len(upfront.registry.planned) and sync_debug.mode == 0  # restored


def test_checks_sync_debug_opts_lazy_capture_in_to_the_process_wide_mode(sync_debug):
    backend = ReservingBackend(FakeAllocator())
    backend._preflight_syncs = True
    backend._sync_debug = True  # what get_backend(..., sync_debug=True) / checks.sync_debug: true set
    manager = _manager(backend, **{"capture.strategy": "lazy"})
    manager.capture()
    assert manager.capture_pending() == len(manager.registry.planned)
    assert sync_debug.history.count(2) == 2 * len(manager.registry.planned)  # the preflight and the warmups
    assert sync_debug.mode == 0


class CachingBackend(ReservingBackend):
    """The caching allocator's rule for a capture, simulated: each warmup leaves its activations in the eager
    cache (taking free device memory), a capture needs fresh device memory and, as on CUDA, cannot free the
    cache to find it (`captures_underway` blocks the release); `empty_cache()` returns the cache."""

    DEVICE, ACTIVATIONS, CAPTURE = 100, 60, 50  # MiB

    def __init__(self, allocator: FakeAllocator) -> None:
        super().__init__(allocator)
        self.free, self.cached = self.DEVICE, 0

    def warmup(self, fn, num_warmups: int, **options) -> None:
        super().warmup(fn, num_warmups, **options)
        if self.cached < self.ACTIVATIONS:  # the activations of every size fit one cached working set
            self.free -= self.ACTIVATIONS - self.cached
            self.cached = self.ACTIVATIONS

    def empty_cache(self) -> None:
        super().empty_cache()
        self.free, self.cached = self.free + self.cached, 0

    def _capture(self, fn, *, name, input_ptrs):
        if self.free < self.CAPTURE:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated): {self.cached} MiB cached, {self.free} free")
        return super()._capture(fn, name=name, input_ptrs=input_ptrs)


def test_a_lazy_key_captures_although_the_warmups_filled_the_cache():
    backend = CachingBackend(FakeAllocator())
    manager = _manager(backend, **{"capture.strategy": "lazy", "capture.memory_budget": None})
    manager.capture()
    assert manager.capture_pending() == len(manager.registry.planned)


def test_without_emptying_the_cache_before_each_capture_a_lazy_key_runs_out_of_memory(monkeypatch):
    # The canary: the cache emptied only where nothing was captured yet (once per pass) leaves the warmups'
    # activations cached when the capture needs the memory.
    backend = CachingBackend(FakeAllocator())
    manager = _manager(backend, **{"capture.strategy": "lazy", "capture.memory_budget": None})
    manager.capture()
    monkeypatch.setattr(backend, "empty_cache", lambda: None)
    with pytest.raises(
        CaptureError, match=r"failed: out of memory \(CUDA out of memory \(simulated\): 60 MiB cached, 40 free\)"
    ):
        manager.capture_pending()
