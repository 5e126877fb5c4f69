"""Ranks whose managers differ in what they were built with (spawned by `_spawn.spawn_world`).

Two ranks. First a manager with peers that rank 0 alone makes (a TP=1 draft model's, on a group
of rank 0 only), then a tensor-parallel manager both make whose rank 1 fails the first warmup of
each size-4 key before its all-reduce: its gloo twin and its ledger must be named alike on both
ranks; its rank 1 then has steps refused after their agreements (its `prepare` breaks a row).
Then data-parallel managers built with different `Parallel` options on each rank. Each
scenario returns what every rank saw, as plain data the parent asserts on.
"""

from __future__ import annotations

import datetime
from typing import Any

import graphcap
from tests.distributed._collective_worker import _step
from tests.distributed._models import CONFIG, GatherMLP, TensorParallelMLP
from tests.distributed._spawn import outcome

TIMEOUT_S = 10.0
"""`Parallel.timeout` and `failure_timeout`, and the model group's own timeout (what a wrong name waits for)."""


def draft_then_tp(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A manager with peers on rank 0 only, then a TP manager on both; then DP managers with other options."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config
    from graphcap.models import build_model

    res: dict[str, Any] = {}
    short = datetime.timedelta(seconds=TIMEOUT_S)
    alone = {r: dist.new_group([r], backend="gloo") for r in range(world)}  # made by every rank, in order
    model_group = dist.new_group(list(range(world)), backend="gloo", timeout=short)
    config = load_config(overrides={**CONFIG, "capture.on_error": "skip"})
    if rank == 0:  # a TP=1 draft model's manager: its group holds this rank alone
        draft = CaptureManager(
            build_model(config), config, backend="emulated",
            parallel=Parallel(tp_group=alone[0], timeout=TIMEOUT_S), progress=False,
        )  # fmt: skip
        res["draft_ledger"] = getattr(draft._peers, "ledger", None)

    model = _Preparing(rank, world, "functional", model_group)
    forward = model.forward

    def failing(inputs):
        if rank == 1 and inputs.key.num_tokens == 4 and graphcap.phase() == "warmup":
            raise RuntimeError("injected failure on rank 1 before the all-reduce")
        return forward(inputs)

    model.forward = failing
    parallel = Parallel(tp_group=model_group, timeout=TIMEOUT_S, failure_timeout=TIMEOUT_S)
    made = outcome(lambda: CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False))
    res["tp_made"] = {k: v for k, v in made.items() if k != "value"}
    if "value" in made:
        manager = made["value"]
        res["tp_ledger"] = getattr(manager._peers, "ledger", None)
        done = res["tp_capture"] = outcome(lambda: len(manager.capture().captured))
        done["skipped"] = sorted(manager.registry.skipped)
        done["completed"] = manager._ledger.completed
        if "value" in done:
            done["steps"] = [_step(manager, model, n, 40 + n) for n in (2, 4)]
            res["tp_refused"] = _refused_after_agreement(rank, manager, model)

    res.update(_options(rank, world))
    res["sampled"] = _sampled(rank, world)
    res["moved"] = _moved_static(rank, world)
    return res


def _moved_static(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 replaces a parameter its graphs read (a static input), steps, then puts it back."""
    import torch
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config

    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    config = load_config(overrides=CONFIG)
    model = GatherMLP(group, world)
    manager = CaptureManager(
        model, config, backend="emulated", parallel=Parallel(dp_group=group, timeout=TIMEOUT_S), progress=False
    )
    manager.capture()
    captured = model.w1
    if rank == 1:
        model.w1 = torch.nn.Parameter(captured.detach().clone(), requires_grad=False)
    res: dict[str, Any] = {"moved": _step(manager, model, (2, 3)[rank], 90 + rank)}
    res["moved"]["eager"] = dict(manager.stats.eager)
    model.w1 = captured
    res["restored"] = _step(manager, model, (2, 3)[rank], 92 + rank)
    return res


def _sampled(rank: int, world: int) -> list[dict[str, Any]]:
    """`checks.sample_every: 2` on two DP ranks whose forward all-gathers; rank 1's second step is refused after
    the agreement (its `prepare` breaks a row): both ranks must go on sampling the same steps."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config
    from tests.distributed._collective_worker import _break_seq_lens

    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    config = load_config(overrides={**CONFIG, "checks.sample_every": 2})
    model = GatherMLP(group, world)
    parallel = Parallel(dp_group=group, timeout=TIMEOUT_S)
    manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
    manager.capture()
    steps = []
    for number in range(1, 6):
        model.on_prepare = _break_seq_lens if (rank, number) == (1, 2) else None
        done = _step(manager, model, (2, 3)[rank], 80 + number)
        done["replays"], done["checked"] = manager._sampler.replays, manager._sampler.checked
        steps.append(done)
    model.on_prepare = None
    return steps


class _Preparing(TensorParallelMLP):
    """The TP shard with a `prepare` that runs `on_prepare(inputs)` when set (after the step's agreements)."""

    on_prepare = None

    def prepare(self, inputs, phase) -> None:
        if self.on_prepare is not None:
            self.on_prepare(inputs)


def _refused_after_agreement(rank: int, manager, model) -> dict[str, Any]:
    """Rank 1's `prepare` breaks a row of a replayed step (2 tokens) and of an eager one (12 tokens): the
    invariants refuse it after the TP and DP agreements; then the same steps again on both ranks."""
    from tests.distributed._collective_worker import _break_seq_lens

    res: dict[str, Any] = {}
    for name, tokens in (("replay", 2), ("eager", 12)):
        model.on_prepare = _break_seq_lens if rank == 1 else None
        res[name] = _step(manager, model, tokens, 70 + tokens)
        model.on_prepare = None
        res[f"{name}_again"] = _step(manager, model, tokens, 70 + tokens)
    res["stats"] = {"hits": sum(manager.stats.graph_hits.values()), "eager": sum(manager.stats.eager.values())}
    return res


def _options(rank: int, world: int) -> dict[str, Any]:
    """DP managers whose ranks pass different `Parallel` options: refused at construction on every rank."""
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config

    group = dist.group.WORLD
    config = load_config(overrides=CONFIG)
    res: dict[str, Any] = {}
    cases = {
        "pad_eager": {"pad_eager": (True, False)[rank]},
        "token_counts": {"token_counts": rank == 0},
        "pad_eager_unset": {"pad_eager": (None, True)[rank]},
    }
    for case, options in cases.items():
        parallel = Parallel(dp_group=group, timeout=TIMEOUT_S, **options)
        res[case] = outcome(
            lambda p=parallel: CaptureManager(
                GatherMLP(group, world), config, backend="emulated", parallel=p, progress=False
            )
        )
        res[case].pop("value", None)
    # The same options on both ranks: built, captured, and a skewed eager step (9 and 12 tokens) pads alike.
    parallel = Parallel(dp_group=group, timeout=TIMEOUT_S, pad_eager=True, token_counts=True)
    model = GatherMLP(group, world)
    manager = CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False)
    manager.capture()
    res["same"] = _step(manager, model, (9, 12)[rank], 60 + rank)
    return res
