"""The poisoned stress loop: random engine-like steps, every real row compared with eager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from graphcap.capture.verification import assert_close
from graphcap.manager import CaptureManager
from graphcap.workload import Workload

__all__ = ["StressResult", "stress"]


@dataclass
class StressResult:
    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0
    uniform_steps: int = 0
    mixed_steps: int = 0
    piecewise_steps: int = 0
    """Of the mixed steps, those that replayed piecewise graphs."""
    real_rows: int = 0


def stress(manager: CaptureManager, num_steps: int, seed: int, *, spec_len: int = 1) -> StressResult:
    """Random engine-like steps, large and small; every real row of every step: graph == eager.

    Requests join, prefill in chunks, decode (or verify `spec_len` drafts) and finish; the
    token budget per step is drawn anew, so steps range from one token to above the largest
    captured size (eager). Raises AssertionError on the first differing step.
    """
    config = manager.config
    workload = Workload(config, seed=seed, chunk=int(np.random.default_rng(seed).integers(3, 12)), spec_len=spec_len)
    rng = workload.rng
    result = StressResult()
    budgets = [1, 2, 3, 4, 5, 8, 8, 12, config.batching.max_num_tokens]
    while result.steps < num_steps:
        # New requests keep arriving (so prefill chunks mix with decodes), up to the limit.
        if not workload.running or (len(workload.running) < config.batching.max_num_seqs and rng.random() < 0.3):
            prompt_len = int(rng.integers(1, int(rng.choice([2, 6, 16])) + 1))
            workload.add(prompt_len, max_new_tokens=int(rng.integers(1, 12)))  # short: turnover
        batch = workload.next_batch(max_tokens=int(rng.choice(budgets)))
        if batch.num_reqs == 0:
            workload.advance(None)
            continue
        key = manager.dispatch(batch)
        out = cast(torch.Tensor, manager.execute(batch)).clone()
        ref = manager.eager(batch)
        try:
            assert_close(out, ref)
        except AssertionError as exc:
            raise AssertionError(f"step {result.steps} ({batch}, key {key}): graph != eager\n{exc}") from None
        workload.advance(out)
        result.steps += 1
        result.real_rows += batch.num_tokens
        if key is None:
            result.eager_steps += 1
        else:
            result.graph_steps += 1
            result.uniform_steps += key.uniform
            result.mixed_steps += not key.uniform
            result.piecewise_steps += key.piecewise
    return result
