"""Two data-parallel ranks that misbehave one at a time (spawned by `_spawn.spawn_world`).

One rank calls `release()`, `reset()` or `resize_kv()` alone, or has its `resize_kv` refused; a
forward with a DP all-gather runs eager steps of different sizes under the default options; lazy
capture counts the demand of skewed steps. Each scenario returns what every rank saw, as plain
data the parent asserts on.
"""

from __future__ import annotations

from typing import Any

from tests.distributed._models import CONFIG, GatherMLP, decodes, reference
from tests.distributed._spawn import outcome

TIMEOUT_S = 30.0


def _close(output, batch) -> str:
    from graphcap.capture.verification import assert_close

    try:
        assert_close(output, reference(batch.input_ids), atol=1e-5, rtol=1e-5)
    except AssertionError as exc:
        return str(exc).splitlines()[-1]
    return "ok"


def _step(manager, num_tokens: int, seed: int, **kwargs) -> dict[str, Any]:
    batch = decodes(num_tokens, seed)
    result = outcome(lambda: manager.execute(batch, **kwargs).clone())
    if "value" in result:
        result["match"] = "ok" if batch is None else _close(result.pop("value"), batch)
    result["key"] = manager.last_key
    return result


def agreed_calls(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Lifecycle calls made on one rank only, the default eager padding, lazy demand (see the module doc)."""
    import torch
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config
    from graphcap.models import build_model

    group = dist.group.WORLD
    config = load_config(overrides=CONFIG)
    res: dict[str, Any] = {}
    model = GatherMLP(group, world)
    manager = CaptureManager(
        model, config, backend="emulated", parallel=Parallel(dp_group=group, timeout=TIMEOUT_S), progress=False
    )
    manager.capture()
    res["graphs"] = len(manager.graphs)
    res["pads"] = manager._peers.pads_eager()  # the forward's all-gather was recorded: eager steps pad
    res["step1"] = _step(manager, 3, 1 + rank, step=1)
    res["step2"] = _step(manager, 2, 2 + rank, step=2)
    # One rank releases while its peer steps: both fail at once, naming each rank's call; nothing changed.
    res["release_alone"] = outcome(manager.release) if rank == 0 else _step(manager, 3, 3, step=3)
    res["after_release_alone"] = (len(manager.graphs), _step(manager, 3, 4 + rank, step=3))
    res["reset_alone"] = _step(manager, 2, 5, step=4) if rank == 0 else outcome(manager.reset)
    res["resize_alone"] = outcome(lambda: manager.resize_kv(40)) if rank == 0 else _step(manager, 2, 6, step=4)
    # Both call resize_kv, rank 1 with a cache of 10 blocks (refused): every rank raises, none released its graphs.
    cache = torch.zeros(10 if rank == 1 else 40, 4)
    res["resize_refused"] = outcome(lambda: manager.resize_kv(40, cache))
    res["graphs_after_refusal"] = len(manager.graphs)
    res["step4"] = _step(manager, 4, 7 + rank, step=4)
    # capture() refused on rank 1 before it agrees (a scratch block out of range): every rank raises, none
    # released a graph, and the next step replays on both.
    res["capture_refused"] = outcome(lambda: manager.capture(scratch_blocks=[999] if rank == 1 else ()))
    res["graphs_after_capture_refused"] = len(manager.graphs)
    res["after_capture_refused"] = _step(manager, 4, 30 + rank, step=5)
    # Eager steps of different sizes with the default pad_eager (None): rank 1 above the largest size.
    res["eager_skewed"] = _step(manager, (2, 12)[rank], 8 + rank, step=6)
    # Every rank releases together: agreed, every later step runs eagerly (reason "released").
    res["release_both"] = outcome(manager.release)
    res["after_release"] = _step(manager, (3, 5)[rank], 9 + rank, step=7)
    res["eager_reasons"] = dict(manager.stats.eager)

    plain = build_model(load_config(overrides={**CONFIG, "model.num_layers": 1}))
    quiet = CaptureManager(
        plain, load_config(overrides={**CONFIG, "model.num_layers": 1}), backend="emulated",
        parallel=Parallel(dp_group=group, timeout=TIMEOUT_S), progress=False,
    )  # fmt: skip
    res["pads_before_capture"] = quiet._peers.pads_eager()  # nothing known yet: pad (the safe side)
    quiet.capture()
    res["pads_without_collectives"] = quiet._peers.pads_eager()

    lazy_config = load_config(overrides={**CONFIG, "capture.strategy": "lazy"})
    lazy = CaptureManager(
        GatherMLP(group, world), lazy_config, backend="emulated",
        parallel=Parallel(dp_group=group, timeout=TIMEOUT_S), progress=False,
    )  # fmt: skip
    lazy.capture()
    for i in range(3):  # 1 and 3 decodes: every rank runs the agreed uniform(4) eagerly (pending)
        _step(lazy, (1, 3)[rank], 20 + i)
    res["demand"] = {str(key): count for key, count in lazy.registry.demand.items() if count}
    res["first_lazy"] = (lazy.capture_pending(max_keys=1), sorted(str(key) for key in lazy.graphs))
    # Rank 0's own uniform(1) is still pending; the agreed uniform(4) has a graph on every rank: it replays.
    res["agreed_serves"] = _step(lazy, (1, 3)[rank], 30 + rank)
    res["agreed_serves"]["hits"] = sum(lazy.stats.graph_hits.values())
    # capture_pending() refused on rank 1 before it agrees: every rank raises and keeps serving.
    res["pending_refused"] = outcome(lambda: lazy.capture_pending(max_keys=1, scratch_blocks=[999] if rank else ()))
    res["pending_refused"]["graphs"] = len(lazy.graphs)
    res["after_pending_refused"] = _step(lazy, (1, 3)[rank], 40 + rank)
    dist.destroy_process_group()
    return res
