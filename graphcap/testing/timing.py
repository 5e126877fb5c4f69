"""Per-key step timing: eager forward vs graph replay, through the manager's real step path.

Used by `graphcap bench`, `tools/bench_capture.py` and `tools/gpu_check.py`. Both sides
include staging and the invariant checks, so the numbers are what an engine pays per step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from graphcap.batch import GraphKey
from graphcap.testing.workload import fill_batch

__all__ = ["KeyTiming", "time_key"]


@dataclass(frozen=True, slots=True)
class KeyTiming:
    """Median milliseconds per step for one key."""

    key: GraphKey
    eager_ms: float
    replay_ms: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.replay_ms if self.replay_ms > 0 else float("inf")


def time_key(manager, key: GraphKey, steps: int = 20, warmup: int = 3) -> KeyTiming | None:
    """Median ms of `manager.eager` and `manager.execute` on a batch that fills `key`.

    None when no real batch reaches `key` (a mixed key of one token: one token is always
    a uniform decode step) or `key` is not captured.
    """
    batch = fill_batch(key, manager.config)
    if manager.dispatch(batch) != key:
        return None
    sync = manager.backend.synchronize

    def median_ms(step) -> float:
        for _ in range(warmup):
            step(batch)
        sync()
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            step(batch)
            sync()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    with manager.uncounted():  # benchmark steps are not engine traffic
        eager_ms = median_ms(manager.eager)
        replay_ms = median_ms(manager.execute)
    return KeyTiming(key, eager_ms, replay_ms)
