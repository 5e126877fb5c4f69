"""The exact peak of torch's CPU allocations while a function runs (what the memory estimate predicts).

Peak resident memory (`VmHWM`) is a noisy stand-in: the C allocator keeps or returns freed
pages, and Python objects and thread arenas count too. `allocation_peak` instead runs `fn`
under `torch.profiler` with `profile_memory=True`, which reports every allocation and free of
torch's CPU allocator with its size, and adds them up in time order: the peak of that running
sum is the most bytes of tensor storage alive at once. Blocks allocated before `fn` ran are not
counted (their frees are not reported either), so `peak` is the growth over what was alive.

Not imported by `graphcap.testing` (it imports torch.profiler): import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocationPeak", "allocation_peak"]


@dataclass(frozen=True, slots=True)
class AllocationPeak:
    """`peak`: the most bytes `fn` had allocated at once; `end`: bytes still allocated when it returned."""

    result: Any
    peak: int
    end: int
    allocations: int


def allocation_peak(fn: Callable[[], Any]) -> AllocationPeak:
    """Run `fn()` once under the profiler and return its result with the peak of its CPU tensor allocations."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        raise RuntimeError(f"torch {torch.__version__}'s profiler has no kineto_results; cannot count allocations")
    sizes = [
        (event.start_ns(), event.nbytes())
        for event in results.events()
        if event.name() == "[memory]" and event.device_type() == torch._C._autograd.DeviceType.CPU
    ]
    sizes.sort()
    current = peak = 0
    for _, size in sizes:
        current += size
        peak = max(peak, current)
    return AllocationPeak(result, peak, current, sum(1 for _, size in sizes if size > 0))
