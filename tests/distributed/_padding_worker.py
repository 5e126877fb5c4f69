"""One data-parallel rank of the padding-factor test (spawned by `_spawn.spawn_world`).

Sizes [1, 16] and `capture.max_padding_factor: 2`. Step "asymmetric": rank 0 prefills 2 tokens (its
graph of 16 would pad 8x: its own check says eager) while the others prefill 12 (16 for 12: within the
factor); every rank must run eagerly. Step "within": rank 0 prefills 9 tokens, the others 12; every
rank replays the 16-token graph. Each step's eager reason (or key) and its match with eager are kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.configs import SMALL

CONFIG = {
    **SMALL,
    "model.num_layers": 1,
    "capture.sizes": [1, 16],
    "capture.max_size": 16,
    "capture.max_padding_factor": 2,
}
SLOW_S = 60.0  # the dp timeout: loaded CI machines are slow
STEPS = {"asymmetric": (2, 12), "within": (9, 12)}
"""Tokens of the one prefill request per step: (rank 0, every other rank)."""


def scenario(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """`spawn_world` target: this rank's steps (see the module doc)."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, StepBatch, load_config
    from graphcap.models import build_model

    config = load_config(overrides=CONFIG)
    manager = CaptureManager(
        build_model(config), config, parallel=Parallel(dp_group=dist.group.WORLD, timeout=SLOW_S), progress=False
    )
    manager.capture()
    result: dict[str, Any] = {"rank": rank}
    for name, tokens in STEPS.items():
        n = tokens[0] if rank == 0 else tokens[1]
        batch = StepBatch([n], [n], np.arange(n) % 100, np.array([[1 + rank, 3, 5, 7]], dtype=np.int32))
        before = dict(manager.stats.eager)
        output = manager.execute(batch).clone()
        key = manager.last_key
        reasons = [r for r, count in manager.stats.eager.items() if count > before.get(r, 0)]
        expected = manager.eager(batch)
        result[name] = {
            "reasons": reasons,
            "key": key,
            "replayed": not reasons,
            "match": bool(torch.allclose(output, expected, atol=1e-5, rtol=1e-5)),
        }
    dist.destroy_process_group()
    return result
