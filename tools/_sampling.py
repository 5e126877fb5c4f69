"""Shared by the benchmarks: per-call timing samples with GC off."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np


def measure(
    fn: Callable[[], object], repeats: int, warmup: int, *, before: Callable[[], object] | None = None
) -> np.ndarray:
    """Microseconds per call, one sample per call, after `warmup` calls (and `before()`).

    GC is off while sampling: a collection inside one sample says nothing about `fn`.
    """
    for _ in range(warmup):
        fn()
    if before is not None:
        before()
    samples = np.empty(repeats, dtype=np.int64)
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for i in range(repeats):
            start = clock()
            fn()
            samples[i] = clock() - start
    finally:
        gc.enable()
    return samples / 1000.0
