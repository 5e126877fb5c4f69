"""Per-key step timing: eager forward vs graph replay, through the manager's real step path.

Used by `graphcap bench`, `tools/bench_capture.py` and `tools/gpu_check.py`. Both sides
include staging and the invariant checks, so the numbers are what an engine pays per step.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import numpy as np

from graphcap.batch import GraphKey, StepBatch, dummy_batch

__all__ = ["KeyTiming", "full_batch", "time_key"]


@dataclass(frozen=True, slots=True)
class KeyTiming:
    """Median milliseconds per step for one key."""

    key: GraphKey
    eager_ms: float
    replay_ms: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.replay_ms if self.replay_ms > 0 else float("inf")


def full_batch(key: GraphKey, config, seed: int = 0) -> StepBatch:
    """A real batch that fills `key` (the dummy layout, with context, token ids and blocks)."""
    rng = np.random.default_rng(seed)
    shape = dummy_batch(key, max_model_len=config.kv_cache.max_model_len)
    q = shape.query_lens
    kv = config.kv_cache
    context = rng.integers(0, np.maximum(1, kv.max_model_len - q + 1))
    blocks = rng.integers(1, kv.num_blocks, (len(q), kv.max_blocks_per_req))
    ids = rng.integers(0, config.model.vocab_size, int(q.sum()))
    return StepBatch(q, q + context, ids, blocks)


def time_key(manager, key: GraphKey, steps: int = 20, warmup: int = 3) -> KeyTiming | None:
    """Median ms of `manager.eager` and `manager.execute` on a batch that fills `key`.

    None when no real batch reaches `key` (a mixed key of one token: one token is always
    a uniform decode step) or `key` is not captured.
    """
    batch = full_batch(key, manager.config)
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

    saved = copy.deepcopy(manager.stats)
    eager_ms = median_ms(manager.eager)
    replay_ms = median_ms(manager.execute)
    manager.stats = saved  # benchmark replays are not engine traffic
    return KeyTiming(key, eager_ms, replay_ms)
