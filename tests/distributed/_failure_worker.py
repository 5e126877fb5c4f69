"""Ranks of the tests of a capture forward failing in the first warmup of a key (spawned by `_spawn.spawn_world`).

Two tensor-parallel ranks; the model's all-reduce runs on its own gloo group. Rank 1 raises in the
first warmup of each size-4 key, before the all-reduce: no forward of that shape has completed on
any rank, so the failing rank learns what its peer waits in from what the peer publishes.
"""

from __future__ import annotations

import datetime
from typing import Any

import graphcap
from tests.distributed._collective_worker import DP_TIMEOUT_S, _step
from tests.distributed._models import CONFIG, GatherMLP, TensorParallelMLP
from tests.distributed._spawn import outcome

CANARY_GROUP_TIMEOUT_S = 3.0
"""The model group's own timeout in the canary: what bounds the peer left in the all-reduce there."""


def _manager(rank: int, world: int, group: Any, on_error: str, *, ledger: bool = True):
    """A TP manager whose model fails on rank 1 in the first warmup of each size-4 key; its model and calls."""
    from graphcap import CaptureManager, load_config

    model = TensorParallelMLP(rank, world, "functional", group)
    forward = model.forward
    calls: list[str] = []

    def failing(inputs):
        calls.append(f"{graphcap.phase()} {inputs.key.num_tokens}")
        if rank == 1 and inputs.key.num_tokens == 4 and graphcap.phase() == "warmup":
            raise RuntimeError("injected failure on rank 1 before the all-reduce")
        return forward(inputs)

    model.forward = failing
    config = load_config(overrides={**CONFIG, "capture.on_error": on_error})
    parallel = graphcap.Parallel(tp_group=group, timeout=DP_TIMEOUT_S, failure_timeout=DP_TIMEOUT_S)
    manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
    if not ledger:  # the canary: the mechanism off
        manager._ledger = None
    return manager, model, calls


def _captured(manager, model, calls) -> dict[str, Any]:
    done = outcome(lambda: len(manager.capture().captured))
    done["skipped"] = sorted(manager.registry.skipped)
    done["reasons"] = [manager.registry.skipped[key] for key in done["skipped"]]
    done["first_failed_forward"] = next((call for call in calls if call.endswith(" 4")), None)
    if manager._ledger is not None:
        done["completed"], done["placeholders"] = manager._ledger.completed, manager._ledger.placeholders
    return done


def first_warmup(rank: int, world: int, directory: str) -> dict[str, Any]:
    """`on_error: raise`, then `on_error: skip` (and steps after it), then the canary without the ledger."""
    import torch.distributed as dist

    res: dict[str, Any] = {}
    model_group = dist.new_group(list(range(world)), backend="gloo")
    manager, model, calls = _manager(rank, world, model_group, "raise")
    agreement = manager._peers.tp.group
    res["own_group"] = agreement is not model_group and agreement is not dist.group.WORLD
    res["own_group_ranks"] = manager._peers.tp.ranks if agreement.size() == 2 else None
    res["raise"] = _captured(manager, model, calls)

    manager, model, calls = _manager(rank, world, model_group, "skip")
    res["skip"] = done = _captured(manager, model, calls)
    if "value" in done:
        done["steps"] = [_step(manager, model, n, 500 + n) for n in (1, 3, 6, 8)]

    res["verify_gather"] = _verification_outlived(rank, world, model_group)

    # The canary: the same failure without the ledger leaves rank 0 in the all-reduce of its first warmup until
    # the model group's own timeout (short here) ends it.
    short = datetime.timedelta(seconds=CANARY_GROUP_TIMEOUT_S)
    canary_group = dist.new_group(list(range(world)), backend="gloo", timeout=short)
    manager, model, calls = _manager(rank, world, canary_group, "raise", ledger=False)
    res["canary"] = _captured(manager, model, calls)
    return res


def _verification_outlived(rank: int, world: int, group: Any) -> dict[str, Any]:
    """Rank 0's eager runs of verification fail before their all-gather, while its peer's verification passes
    (the model scales the gathered values by 0, so the zeros rank 0 sends change nothing): the peer goes on
    to the next replay, whose all-gather rank 0 issues from what the peer's tape publishes."""
    from graphcap import CaptureManager, load_config

    model = GatherMLP(group, world)
    forward = model.forward

    def failing(inputs):
        if rank == 0 and graphcap.phase() == "verify":
            raise RuntimeError("injected failure on rank 0 before the all-gather")
        return forward(inputs)

    model.forward = failing
    config = load_config(overrides={**CONFIG, "capture.on_error": "raise"})
    parallel = graphcap.Parallel(dp_group=group, timeout=DP_TIMEOUT_S, failure_timeout=DP_TIMEOUT_S)
    manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
    done = outcome(lambda: len(manager.capture().captured))
    done["completed"], done["placeholders"] = manager._ledger.completed, manager._ledger.placeholders
    return done
