"""The exact peak of torch's CPU allocations while a function runs (what the memory estimate predicts).

Peak resident memory (`VmHWM`) is a noisy stand-in: the C allocator keeps or returns freed
pages, and Python objects and thread arenas count too. `allocation_peak` instead runs `fn`
under `torch.profiler` with `profile_memory=True`, which reports every allocation and free of
torch's CPU allocator with its size, and adds them up in time order: the peak of that running
sum is the most bytes of tensor storage alive at once. Blocks allocated before `fn` ran are not
counted (their frees are not reported either), so `peak` is the growth over what was alive.
The budget measures a model it has no arithmetic for with the same function
(`graphcap.memory.measured`, where it lives).

Not imported by `graphcap.testing` (it imports torch.profiler): import this module.
"""

from __future__ import annotations

from graphcap.memory.measured import AllocationPeak, allocation_peak

__all__ = ["AllocationPeak", "allocation_peak"]
