"""The graph memory of one key, measured on the model that is there (not computed from `model.*`).

A model the engine brings (an object passed to `CaptureManager`, or a `model.factory` model) is not
graphcap's built-in `tiny-llama`, whose arithmetic `graphcap.memory.estimate` knows. For it the budget
(`capture.memory_budget`) takes each key's figures from one eager forward of the key's dummy batch,
staged as its warmup is, before the key is admitted:

- emulated backend: `allocation_peak`, the exact peak of torch's CPU allocations while the forward
  runs (every allocation and free the profiler reports, added up in time order);
- `cuda`: the caching allocator's peak (`torch.cuda.max_memory_allocated`) above what was allocated
  before the forward.

The key's `output` is the bytes of the distinct storages the forward returns; its `activations` the
peak above them (so `activations + output` is the peak, what one shared CUDA pool must hold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphcap.memory.estimate import GraphMemory

__all__ = ["AllocationPeak", "allocation_peak", "measure_graph"]


@dataclass(frozen=True, slots=True)
class AllocationPeak:
    """`peak`: the most bytes `fn` had allocated at once; `end`: bytes still allocated when it returned."""

    result: Any
    peak: int
    end: int
    allocations: int


def allocation_peak(fn: Callable[[], Any]) -> AllocationPeak:
    """Run `fn()` once under the profiler and return its result with the peak of its CPU tensor allocations.

    Blocks allocated before `fn` ran are not counted (their frees are not reported either), so `peak` is
    the growth over what was alive.
    """
    from torch.profiler import ProfilerActivity, profile

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


def measure_graph(num_tokens: int, num_reqs: int, run: Callable[[], Any], backend: Any) -> GraphMemory:
    """`run` (the key's forward on its staged dummy batch) once, eagerly, measured on `backend`."""
    if backend.name == "cuda":
        device = backend.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            output = run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:

        def measured() -> Any:
            with torch.inference_mode():
                return run()

        found = allocation_peak(measured)
        output, peak = found.result, found.peak
    returned = _storage_bytes(output)
    activations = max(0, peak - returned)
    return GraphMemory(num_tokens, num_reqs, activations, peak, returned)


def _storage_bytes(output: Any) -> int:
    """Bytes of the distinct storages of the tensors in `output` (a tensor, or a tuple, list or dict of them)."""
    if isinstance(output, torch.Tensor):
        tensors = [output]
    elif isinstance(output, dict):
        tensors = [t for t in output.values() if isinstance(t, torch.Tensor)]
    elif isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
    else:
        tensors = []
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
