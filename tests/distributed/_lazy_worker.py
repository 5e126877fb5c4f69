"""One data-parallel rank of the lazy-capture test (spawned by `_spawn.spawn_world`): steps, `capture_pending` calls.

Each rank sends different traffic (rank 0 decodes 3 requests, the others 6), so the ranks' own
orders of pending keys differ; `capture_pending` must still capture the same keys on every rank.
Rank 0 asks for one key per call and the others for three: every rank stops with the first that
stops. The result holds, after each call, the keys captured (in order), and every step's output
beside its eager reference. Then an upfront manager with `capture.min_speedup: 1` whose last rank
times every replay below it (a forced asymmetry): every rank must drop every key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.configs import SMALL

CONFIG = {**SMALL, "model.num_layers": 1, "capture.strategy": "lazy"}
SLOW_S = 60.0  # the dp timeout: loaded CI machines are slow


def _decode(num_reqs: int, seed: int):
    from graphcap import StepBatch

    rng = np.random.default_rng(seed)
    table = np.arange(1, 1 + num_reqs * 4, dtype=np.int32).reshape(num_reqs, 4)
    return StepBatch(np.ones(num_reqs, np.int32), rng.integers(2, 40, num_reqs), rng.integers(0, 512, num_reqs), table)


def scenario(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """`spawn_world` target: this rank's steps and `capture_pending` calls (see the module doc)."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config
    from graphcap.models import build_model

    config = load_config(overrides=CONFIG)
    manager = CaptureManager(
        build_model(config), config, parallel=Parallel(dp_group=dist.group.WORLD, timeout=SLOW_S), progress=False
    )
    result: dict[str, Any] = {"rank": rank, "calls": [], "mismatches": [], "keys": []}
    manager.capture()
    step = 0

    def serve(num_steps: int) -> None:
        nonlocal step
        for _ in range(num_steps):
            batch = _decode(3 if rank == 0 else 6, seed=1000 * rank + step)
            output = manager.execute(batch).clone()
            result["keys"].append(manager.last_key)
            expected = manager.eager(batch)
            if not torch.allclose(output, expected, atol=1e-5, rtol=1e-5):
                result["mismatches"].append(step)
            step += 1

    serve(3)
    for max_keys in (1, 1, None):
        count = manager.capture_pending(max_keys=max_keys if rank == 0 else (3 if max_keys else None))
        result["calls"].append((count, sorted(manager.graphs)))
        serve(2)
    result["eager"] = dict(manager.stats.eager)
    result["planned"] = len(manager.registry.planned)
    result["min_speedup"] = _one_rank_too_slow(
        rank, load_config(overrides={**CONFIG, "capture.strategy": "upfront", "capture.min_speedup": 1.0})
    )
    dist.destroy_process_group()
    return result


def _one_rank_too_slow(rank: int, config) -> dict[str, Any]:
    """A forced asymmetry: the last rank times every replay at 0.5x eager, rank 0 at 100x; every rank drops them."""
    import torch.distributed as dist

    import graphcap.capture.verifier
    from graphcap import CaptureManager, Parallel
    from graphcap.models import build_model

    speedup = 0.5 if rank == dist.get_world_size() - 1 else 100.0
    graphcap.capture.verifier.replay_speedup = lambda *args, **kwargs: speedup
    manager = CaptureManager(
        build_model(config), config, parallel=Parallel(dp_group=dist.group.WORLD, timeout=SLOW_S), progress=False
    )
    report = manager.capture()
    return {"graphs": len(manager.graphs), "reasons": sorted({r.reason for r in report.records})}
