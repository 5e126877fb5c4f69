"""The real `CUDAGraphBackend` on the CPU: torch.cuda's streams, graphs, pool handles and memory counters
simulated (the allocator's pool bookkeeping by `FakeAllocator`, with PyTorch's rules).

What it reproduces: the order of the backend's CUDA calls (cache emptied, generators registered,
`capture_begin(pool, capture_error_mode)`, `capture_end`), which pool handle each capture and each
reservation records to, and the bytes a reservation asks the caching allocator for (with the small /
large split the allocator applies: a request of 1 MiB or less takes a 2 MiB small segment shared by two).
What it does not: kernels (a "capture" runs the forward on the CPU; a replay does nothing), so replays
are never compared with eager here (tests/backends/test_cuda.py does that on a GPU).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from graphcap.backends.cuda import SMALL_REQUEST, SMALL_SEGMENT, CUDAGraphBackend
from tests.backends.fake_allocator import FakeAllocator, FakeCUDAGraph

CUDA0 = torch.device("cuda", 0)


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class SimulatedCUDA:
    """torch.cuda replaced for one test: `backend()` builds a real `CUDAGraphBackend` on top of it.

    `allocations`: (bytes, the pool handles recording) of every device allocation (`torch.empty` on a CUDA
    device); `reserved`: what `torch.cuda.memory_reserved()` reads, grown by the segments those take
    (large requests: their own size; small ones: one 2 MiB segment per two 1 MiB blocks alive together).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocator = FakeAllocator().install(monkeypatch)
        self.allocations: list[tuple[int, set]] = []
        self.reserved = 0
        self.graphs: list[FakeCUDAGraph] = []
        self.sync_debug = SimpleNamespace(mode=0, history=[])
        handles = itertools.count(1)
        real_empty = torch.empty
        simulated = self

        class Graph(FakeCUDAGraph):
            """What `torch.cuda.CUDAGraph()` makes here."""

            def __init__(self) -> None:
                super().__init__(simulated.allocator)
                simulated.graphs.append(self)

        cuda = torch.cuda
        for name, value in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "Stream": lambda device=None: _Stream(),
            "current_stream": lambda device=None: _Stream(),
            "stream": lambda stream: _NullContext(),
            "device": lambda device: _NullContext(),
            "graph_pool_handle": lambda: (0, next(handles)),
            "CUDAGraph": Graph,
            "memory_reserved": lambda device=None: self.reserved,
            "mem_get_info": lambda device=None: (80 << 30, 80 << 30),
            "get_sync_debug_mode": lambda: self.sync_debug.mode,
            "set_sync_debug_mode": self._set_sync_debug,
        }.items():
            monkeypatch.setattr(cuda, name, value)
        host_empty = lambda: self.allocator.calls.append("host_empty_cache")  # noqa: E731
        monkeypatch.setattr(torch._C, "_host_emptyCache", host_empty, raising=False)  # absent from CPU builds
        small_blocks = {"free": 0}

        def empty(*size, dtype=None, device=None, **kwargs):
            if device is None or torch.device(device).type != "cuda":
                return real_empty(*size, dtype=dtype, device=device, **kwargs)
            (num_bytes,) = size
            self.allocations.append((num_bytes, set(self.allocator.recording)))
            if num_bytes > SMALL_REQUEST:
                self.reserved += num_bytes
            elif small_blocks["free"]:
                small_blocks["free"] -= 1
            else:  # a fresh small segment: two blocks of 1 MiB
                self.reserved += SMALL_SEGMENT
                small_blocks["free"] += SMALL_SEGMENT // SMALL_REQUEST - 1
            return real_empty(0, dtype=dtype)

        monkeypatch.setattr(torch, "empty", empty)

    def _set_sync_debug(self, value) -> None:
        self.sync_debug.mode = {"default": 0, "warn": 1, "error": 2}.get(value, value)
        self.sync_debug.history.append(self.sync_debug.mode)

    def backend(self, **kwargs) -> CUDAGraphBackend:
        return CUDAGraphBackend(CUDA0, **kwargs)

    def begins(self) -> list[tuple]:
        """Each `capture_begin` call: (pool handle, capture_error_mode)."""
        return [call[1:] for call in self.allocator.calls if call[0:1] == ("capture_begin",)]
