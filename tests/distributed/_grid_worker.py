"""Ranks of a TP 2 x DP 2 grid where one rank misbehaves alone (spawned by `_spawn.spawn_world`).

DP groups {0, 2} and {1, 3}, TP groups {0, 1} and {2, 3}; a column/row-parallel MLP whose
all-reduce runs on the TP group. Rank 3 alone calls `release()`, `capture()`, `reset()` or
`dispatch()` while ranks 0-2 execute a step: every rank must fail that call's agreement, out of
step, naming every rank's call, keep its graphs, and replay the next matching step.
"""

from __future__ import annotations

from typing import Any

from tests.distributed._collective_worker import _step
from tests.distributed._models import CONFIG, TensorParallelMLP, decodes
from tests.distributed._spawn import outcome

TIMEOUT_S = 15.0
"""`Parallel.timeout`: what a rank left waiting in its next agreement would wait for."""

LONE = 3
"""The rank that makes a call alone."""


def grid_groups(rank: int) -> tuple[Any, Any]:
    """This rank's DP and TP groups of the 2 x 2 grid (every rank makes every group, in the same order)."""
    import torch.distributed as dist

    dp_groups = {r: g for ranks in ([0, 2], [1, 3]) for g in [dist.new_group(ranks)] for r in ranks}
    tp_groups = {r: g for ranks in ([0, 1], [2, 3]) for g in [dist.new_group(ranks)] for r in ranks}
    return dp_groups[rank], tp_groups[rank]


def lone_calls(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Each lifecycle call made by rank 3 alone while ranks 0-2 execute; then the same step on every rank."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config

    dp, tp = grid_groups(rank)
    model = TensorParallelMLP(dist.get_rank(tp), 2, "functional", tp)
    config = load_config(overrides=CONFIG)
    parallel = Parallel(dp_group=dp, tp_group=tp, timeout=TIMEOUT_S)
    manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
    manager.capture()
    res: dict[str, Any] = {"graphs": len(manager.graphs)}
    replica = rank // 2  # TP ranks share a batch; the two replicas step with different ones
    step = 1
    res["first"] = _step(manager, model, (2, 3)[replica], 10 * step + replica, step=step)
    calls = {
        "release": manager.release,
        "capture": manager.capture,
        "reset": manager.reset,
        "dispatch": lambda: manager.dispatch(decodes(3, 99), step=step),
    }
    for name, call in calls.items():
        step += 1
        if rank == LONE:
            done = outcome(call)
        else:
            done = _step(manager, model, (2, 3)[replica], 10 * step + replica, step=step)
        done["graphs"] = len(manager.graphs)
        done["next"] = _step(manager, model, (2, 3)[replica], 10 * step + replica, step=step)
        res[name] = done
    return res
