"""One data-parallel rank of the key-axes test (spawned by `_spawn.spawn_world`): steps whose slot counts differ.

Rank 0 and rank 1 state different `lora` values each step; the agreement takes each axis's largest, so
both replay the same combination, or (a value above `capture.axes.lora`'s largest on one rank) both run
eagerly. Every step's output is compared with the rank's own eager run (its own, unpadded value).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.axes_models import AXES, SlotLlama, buffers, lora_step
from tests.distributed._spawn import outcome

SLOW_S = 60.0  # the dp timeout: loaded CI machines are slow
STEPS = [  # per step, each rank's (query lens, adapters) or None (idle)
    (([1], [1]), ([1, 1, 1], [0, 2, 5])),  # lora 1 and 3: both replay lora=4
    (([1, 1], [-1, -1]), ([1] * 5, [0, 1, 2, 3, 4])),  # lora 0 and 5 (above 4): both eager
    (None, ([2, 1], [3, 4])),  # idle and lora 2: both replay lora=2
    (([1], [1]), ([1, 1], [0, -1])),  # rank 0 names an axis the config lacks: it joins idle, then raises
]


def scenario(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """`spawn_world` target: capture, then the scripted steps (see the module doc)."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, StepBatch
    from graphcap.testing import make_config

    config = make_config({"capture.axes": AXES, "capture.sizes": [4, 8]})
    model = SlotLlama(config)
    parallel = Parallel(dp_group=dist.group.WORLD, timeout=SLOW_S)
    manager = CaptureManager(model, config, parallel=parallel, progress=False, buffers=buffers())
    result: dict[str, Any] = {"rank": rank, "captured": len(manager.capture().captured), "steps": []}
    for number, plan in enumerate(STEPS):
        spec = plan[rank]
        batch = None if spec is None else lora_step(*spec, seed=10 * rank + number)
        if number == 3 and rank == 0:  # an axis name the config does not plan
            batch = StepBatch(batch.query_lens, batch.seq_lens, batch.input_ids, extras=batch.extras, axes={"lroa": 1})
        done = outcome(lambda: manager.execute(batch).clone())  # noqa: B023
        step: dict[str, Any] = {"key": manager.last_key, **{k: v for k, v in done.items() if k != "value"}}
        if "value" in done and batch is not None:
            step["matches_eager"] = bool(torch.allclose(done["value"], manager.eager(batch), atol=1e-5, rtol=1e-5))
        result["steps"].append(step)
    result["eager"] = dict(manager.stats.eager)
    result["graph_hits"] = {str(k): v for k, v in manager.stats.graph_hits.items()}
    # pad_eager: an eager step pads to the largest counts and axis values of any rank (one shape everywhere)
    none = make_config({"capture.axes": AXES, "capture.sizes": [4, 8], "capture.mode": "none"})
    parallel = Parallel(dp_group=dist.group.WORLD, timeout=SLOW_S, pad_eager=True)
    padded = CaptureManager(SlotLlama(none), none, parallel=parallel, progress=False, buffers=buffers())
    spec = STEPS[0][rank]
    batch = lora_step(*spec, seed=rank)
    output = padded.execute(batch).clone()
    result["pad_eager"] = {"key": padded.last_key, "matches_eager": bool(torch.allclose(output, padded.eager(batch)))}
    return result
