"""Ranks of the multi-rank tests whose forwards hold collectives (spawned by `_spawn.spawn_world`).

Each function is one rank: it builds its manager on the world gloo group, runs the scenarios of
one test module in order and returns what happened, as plain data the parent asserts on.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

import graphcap
from graphcap.capture.verification import assert_close
from tests.distributed._models import (
    CONFIG,
    GatherMLP,
    TensorParallelMLP,
    decodes,
    reference,
    tape_ops,
)
from tests.distributed._spawn import outcome

DP_TIMEOUT_S = 30.0


def _close(output: torch.Tensor, batch) -> str:
    """ "ok" when `output` equals the single-process reference of `batch`, else the difference."""
    expected = reference(batch.input_ids) if batch is not None else torch.zeros(0, output.shape[-1])
    try:
        assert_close(output, expected, atol=1e-5, rtol=1e-5)
    except AssertionError as exc:
        return str(exc).splitlines()[-1]
    return "ok"


def _step(manager, model, num_tokens: int, seed: int, **kwargs) -> dict[str, Any]:
    batch = decodes(num_tokens, seed, bad_block=kwargs.pop("bad_block", False))
    result = outcome(lambda: manager.execute(batch, **kwargs).clone())
    if "value" in result:
        result["match"] = _close(result.pop("value"), batch)
    result["key"] = manager.last_key
    result["seen"] = model.seen.tolist() if hasattr(model, "seen") else None
    return result


def _break_seq_lens(inputs) -> None:
    """A real step's `prepare` that breaks a row: the invariants refuse the step after its agreement."""
    if inputs.num_tokens:
        inputs.host.seq_lens[0] = -1


def data_parallel(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Two DP ranks, a forward with a DP all-gather, `pad_eager` and the per-rank token counts."""
    import torch.distributed as dist

    from graphcap import CaptureManager, load_config

    config = load_config(overrides=CONFIG)
    model = GatherMLP(dist.group.WORLD, world)
    manager = CaptureManager(
        model,
        config,
        backend="emulated",
        parallel=graphcap.Parallel(dp_group=dist.group.WORLD, timeout=DP_TIMEOUT_S, pad_eager=True, token_counts=True),
        progress=False,
    )
    manager.capture()
    res: dict[str, Any] = {"graphs": len(manager.graphs)}
    res["graph"] = _step(manager, model, (3, 6)[rank], 10 + rank)
    res["idle"] = _step(manager, model, (3, 0)[rank], 20 + rank)
    res["eager"] = _step(manager, model, (3, 9)[rank], 30 + rank)  # rank 1 above the largest size
    res["refused"] = _step(manager, model, 3, 40 + rank, bad_block=rank == 1)
    if rank == 1:
        model.on_prepare = _break_seq_lens
    res["refused_after"] = _step(manager, model, (2, 5)[rank], 50 + rank)
    model.on_prepare = None
    res["after_refusals"] = _step(manager, model, (4, 2)[rank], 60 + rank)
    res["engine_steps"] = _step(manager, model, 3, 70 + rank, step=(10, 11)[rank])  # rank 1 skipped step 10
    res["engine_steps_again"] = _step(manager, model, 3, 80 + rank, step=12)
    if rank == 0:  # rank 0 captures while rank 1 steps
        res["mismatch"] = outcome(manager.capture)
    else:
        res["mismatch"] = _step(manager, model, 3, 90)
    res["graphs_after_mismatch"] = len(manager.graphs)
    res["after_mismatch"] = _step(manager, model, (1, 7)[rank], 100 + rank)
    res["stats"] = manager.stats.as_dict()
    if rank == 0:  # rank 0 captures in idle time while rank 1 steps: named as the call it is
        res["pending_mismatch"] = outcome(manager.capture_pending)
    else:
        res["pending_mismatch"] = _step(manager, model, 3, 110)
    return res


def data_parallel_death(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 1 dies after the agreement of its second step, before the graph's all-gather."""
    import torch.distributed as dist

    from graphcap import CaptureManager, load_config

    config = load_config(overrides=CONFIG)
    model = GatherMLP(dist.group.WORLD, world)
    manager = CaptureManager(
        model, config, backend="emulated", parallel=graphcap.Parallel(dp_group=dist.group.WORLD, timeout=DP_TIMEOUT_S),
        progress=False,
    )  # fmt: skip
    manager.capture()
    res = {"first": _step(manager, model, 3, 1 + rank)}
    if rank == 1:
        model.on_prepare = lambda inputs: os.kill(os.getpid(), signal.SIGKILL)
    res["second"] = _step(manager, model, 3, 2 + rank)
    return res


def tensor_parallel(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Two TP ranks: each all-reduce spelling, the custom all-reduce, TP ranks fed different batches."""
    import torch.distributed as dist

    from graphcap import CaptureManager, load_config

    config = load_config(overrides=CONFIG)
    group = dist.group.WORLD
    res: dict[str, Any] = {}
    for spelling in ("functional", "funcol", "inplace", "custom_graphcap", "custom_cuda", "custom_stream"):
        model = TensorParallelMLP(rank, world, spelling, group)
        context = model.custom.capture if model.custom is not None else None
        manager = CaptureManager(
            model, config, backend="emulated", parallel=graphcap.Parallel(tp_group=group, timeout=DP_TIMEOUT_S),
            progress=False, capture_context=context,
        )  # fmt: skip
        done = res[spelling] = outcome(lambda: len(manager.capture().captured))  # noqa: B023
        if "value" in done:
            done["steps"] = [_step(manager, model, n, 100 * n) for n in (1, 3, 8, 12)]
            done["tape"] = tape_ops(manager.graphs[max(manager.graphs)])
    model = TensorParallelMLP(rank, world, "functional", group)
    tp_only = graphcap.Parallel(tp_group=group, timeout=DP_TIMEOUT_S)
    manager = CaptureManager(model, config, backend="emulated", parallel=tp_only, progress=False)
    manager.capture()
    res["same"] = _step(manager, model, 3, 7)
    res["other_size"] = _step(manager, model, (3, 5)[rank], 8)  # different keys: 4 and 8
    res["other_tokens"] = _step(manager, model, 3, 9 + rank)  # the same key, other token ids
    res["same_again"] = _step(manager, model, 6, 10)
    # Rank 1's batch is refused while rank 0 stages 8 rows; then identical small steps: only the key's rows count.
    res["refused_big"] = _step(manager, model, 8, 11, bad_block=rank == 1)
    res["small_after"] = [_step(manager, model, 1, 12), _step(manager, model, 2, 13)]
    res["refused_twice"] = [_step(manager, model, 3, 14, bad_block=rank == 0) for _ in range(2)]
    res.update(_wrapped_capture(rank, world, config, tp_only))
    res.update(_failing_before_collective(rank, world, tp_only))
    return res


def _failing_before_collective(rank: int, world: int, parallel) -> dict[str, Any]:
    """A rank whose capture forward raises before its all-reduce: in the recording of size 4 (rank 1, on_error:
    skip), in the verification of size 8 (rank 0, on_error: raise). Its peer is inside that all-reduce."""
    import torch.distributed as dist

    from graphcap import CaptureManager, load_config

    res: dict[str, Any] = {}
    cases = {"fail_recording": ("skip", 1, "capture", 4), "fail_verify": ("raise", 0, "verify", 8)}
    for case, (on_error, failing, when, size) in cases.items():
        model = TensorParallelMLP(rank, world, "functional", dist.group.WORLD)
        forward = model.forward

        def failing_forward(inputs, forward=forward, failing=failing, when=when, size=size):
            if rank == failing and graphcap.phase() == when and inputs.key.num_tokens == size:
                raise RuntimeError(f"injected failure on rank {rank} before the all-reduce")
            return forward(inputs)

        model.forward = failing_forward
        config = load_config(overrides={**CONFIG, "capture.on_error": on_error})
        manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
        done = res[case] = outcome(lambda: len(manager.capture().captured))  # noqa: B023
        done["skipped"] = sorted(manager.registry.skipped)
        done["reasons"] = [manager.registry.skipped[key] for key in done["skipped"]]
        if "value" in done:
            done["steps"] = [_step(manager, model, n, 300 + n) for n in (3, 8)]
        done["completed"] = manager._ledger.completed
    return res


def _wrapped_capture(rank: int, world: int, config, parallel) -> dict[str, Any]:
    """An engine that wraps capture() in its own capture mode, its custom all-reduce asking torch's stream query:
    with the emulated backend answering as CUDA does, verification refuses; without that answer (the canary),
    every key "verifies" with placeholders everywhere and replays differ from the reference."""
    import contextlib

    import torch.distributed as dist

    import graphcap.backends.emulated as emulated
    from graphcap import CaptureManager

    res: dict[str, Any] = {}
    for case in ("wrapped", "wrapped_unanswered"):
        model = TensorParallelMLP(rank, world, "custom_stream", dist.group.WORLD)
        manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
        answer = emulated.stream_capturing
        if case == "wrapped_unanswered":
            emulated.stream_capturing = contextlib.nullcontext
        try:
            with model.custom.capture():
                done = res[case] = outcome(lambda: len(manager.capture().captured))  # noqa: B023
        finally:
            emulated.stream_capturing = answer
        if "value" in done:
            done["steps"] = [_step(manager, model, n, 200 + n) for n in (1, 3)]
    return res


def grid(rank: int, world: int, directory: str) -> dict[str, Any]:
    """TP 2 x DP 2 on four ranks: DP groups {0, 2} and {1, 3}, TP groups {0, 1} and {2, 3}.

    The DP group reports an NCCL backend (patched: no NCCL on a CPU), so graphcap makes its gloo
    twin over the DP ranks alone. Replica 0 (ranks 0, 1) and replica 1 (ranks 2, 3) step with
    different batches; rank 1's recording of size 4 fails.
    """
    import torch.distributed as dist

    from graphcap import CaptureManager, load_config
    from graphcap.models import build_model

    dp_groups = {r: g for ranks in ([0, 2], [1, 3]) for g in [dist.new_group(ranks)] for r in ranks}
    tp_groups = {r: g for ranks in ([0, 1], [2, 3]) for g in [dist.new_group(ranks)] for r in ranks}
    dp, tp = dp_groups[rank], tp_groups[rank]
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is dp else real(group)
    res: dict[str, Any] = {}
    config = load_config(overrides={**CONFIG, "capture.on_error": "skip"})
    # Rank 0 alone loads other capture sizes: every rank of the grid refuses, naming the field and both values.
    own = (
        load_config(overrides={**CONFIG, "capture.on_error": "skip", "capture.sizes": [1, 2, 4]})
        if rank == 0
        else config
    )
    both = graphcap.Parallel(dp_group=dp, tp_group=tp, timeout=DP_TIMEOUT_S)
    res["config"] = outcome(lambda: CaptureManager(build_model(own), own, parallel=both, progress=False))
    # A DP-only manager per DP group, made at the same time by both groups (no graphs: dispatch is eager).
    dp_only = CaptureManager(
        build_model(config), config, parallel=graphcap.Parallel(dp_group=dp, timeout=DP_TIMEOUT_S), progress=False
    )
    res["dp_only"] = dp_only.dispatch(decodes(rank + 1, rank))

    from graphcap.distributed import GroupSync

    sync = GroupSync(dp, timeout=DP_TIMEOUT_S)
    res["twin_ranks"] = sync.ranks if sync.group.size() == len(sync.ranks) else None
    res["twin_is_new"] = sync.group is not dp
    res["reduced"] = sync.reduce_max([rank], "probe")
    model = TensorParallelMLP(dist.get_rank(tp), 2, "functional", tp)
    forward = model.forward

    def failing(inputs):
        # In the first warmup of each size-4 key, before its TP all-reduce: no forward of that shape has run yet;
        # rank 1 issues the collectives its TP peer publishes (the rest of the warmups and the recording).
        if rank == 1 and inputs.key.num_tokens == 4 and graphcap.phase() == "warmup":
            raise RuntimeError("injected failure on rank 1")
        return forward(inputs)

    model.forward = failing
    manager = CaptureManager(
        model, config, backend="emulated", parallel=graphcap.Parallel(dp_group=dp, tp_group=tp, timeout=DP_TIMEOUT_S),
        progress=False,
    )  # fmt: skip
    manager.capture()
    res["captured"] = sorted(manager.registry.captured)
    res["skipped"] = sorted(manager.registry.skipped)
    res["completed"] = manager._ledger.completed
    replica = rank // 2
    res["steps"] = [_step(manager, model, n, seed) for seed, n in enumerate(((2, 6), (1, 2), (5, 12))[i][replica]
                                                                           for i in range(3))]  # fmt: skip
    return res
