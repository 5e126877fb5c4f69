"""How the CUDA backend cleans up after a failed capture, on the CPU: the allocator's pool bookkeeping is
simulated with PyTorch's own rules (tests/backends/fake_allocator.py), in the order each torch version ends
a capture CUDA invalidated. tests/backends/test_cuda.py checks the same on a GPU with the torch it has."""

from __future__ import annotations

import pytest
import torch

import graphcap.backends.pool as pool_module
from graphcap.backends.pool import discard_capture
from tests.backends.fake_allocator import ORDERS, FakeAllocator, FakeCUDAGraph

DEVICE, HANDLE = torch.device("cuda", 3), (0, 7)


@pytest.fixture
def allocator(monkeypatch) -> FakeAllocator:
    allocator = FakeAllocator().install(monkeypatch)
    allocator.begin(3, HANDLE)  # a graph captured earlier is alive in the pool
    allocator.end(3, HANDLE)
    allocator.calls.clear()
    return allocator


def _failed_capture(allocator, order: str, reset_releases: bool) -> FakeCUDAGraph:
    graph = FakeCUDAGraph(allocator, order, reset_releases)
    graph.capture_begin(HANDLE)
    with pytest.raises(RuntimeError, match="CUDA error"):
        graph.capture_end(invalidated=True)
    return graph


@pytest.mark.parametrize("version", list(ORDERS))
def test_an_invalidated_capture_stops_recording_and_releases_its_use_exactly_once(allocator, monkeypatch, version):
    release, order, reset_releases = ORDERS[version]
    monkeypatch.setattr(pool_module, "_TORCH_RELEASE", release)
    graph = _failed_capture(allocator, order, reset_releases)
    assert allocator.use_count[HANDLE] == 2  # the live graph's use and the failed capture's
    discard_capture(graph, DEVICE, HANDLE, began=True)
    assert HANDLE not in allocator.recording
    assert allocator.use_count[HANDLE] == 1  # the live graph's use is untouched: its memory stays valid
    assert allocator.calls.count("empty_cache") == 1


def test_without_the_release_a_failed_capture_on_torch_2_12_pins_the_pool_for_good(allocator, monkeypatch):
    # The canary of the test above: torch 2.12 and 2.13 end the recording, then raise, and their
    # reset() releases nothing; skipping the release (as for torch 2.11's order) leaks the use.
    monkeypatch.setattr(pool_module, "_TORCH_RELEASE", (2, 11))
    graph = _failed_capture(allocator, "end_then_raise", reset_releases=False)
    discard_capture(graph, DEVICE, HANDLE, began=True)
    assert allocator.use_count[HANDLE] == 2


def test_a_version_not_known_to_leave_the_release_to_its_caller_is_never_released_twice(allocator, monkeypatch):
    # A torch newer than 2.13 whose reset() still keeps the use: a leak (the pool was rotated away),
    # never a second release, which would free the memory of the graph still alive in the pool.
    monkeypatch.setattr(pool_module, "_TORCH_RELEASE", (2, 15))
    graph = _failed_capture(allocator, "end_then_raise", reset_releases=False)
    discard_capture(graph, DEVICE, HANDLE, began=True)
    assert allocator.use_count[HANDLE] == 2


def test_a_completed_capture_is_left_to_reset(allocator):
    # The forward raised, capture_end completed: reset() releases the pool, nothing else may.
    graph = FakeCUDAGraph(allocator)
    graph.capture_begin(HANDLE)
    graph.capture_end()
    allocator.calls.clear()
    discard_capture(graph, DEVICE, HANDLE, began=True)
    assert allocator.use_count[HANDLE] == 1
    assert allocator.calls == ["reset", ("release", HANDLE), "synchronize", "empty_cache"]


def test_a_capture_begin_that_failed_after_starting_the_recording_is_ended_and_released(allocator):
    graph = FakeCUDAGraph(allocator)
    with pytest.raises(RuntimeError):
        graph.capture_begin(HANDLE, fail_after_recording=True)
    discard_capture(graph, DEVICE, HANDLE, began=False)
    assert HANDLE not in allocator.recording and allocator.use_count[HANDLE] == 1


def test_a_capture_begin_that_failed_before_the_allocator_is_never_released(allocator, monkeypatch):
    monkeypatch.setattr(pool_module, "_TORCH_RELEASE", (2, 13))
    graph = FakeCUDAGraph(allocator)  # capture_begin refused (default stream, say): nothing was taken
    discard_capture(graph, DEVICE, HANDLE, began=False)
    assert allocator.use_count[HANDLE] == 1 and ("release", HANDLE) not in allocator.calls
