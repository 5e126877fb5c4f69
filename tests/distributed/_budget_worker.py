"""Two tensor-parallel ranks whose graphs differ in size under `capture.memory_budget` (`_spawn.spawn_world`).

The head is vocab-parallel with an uneven split (rank 0: 80 logits columns, rank 1: 48), so each
rank's graphs hold different bytes. Each rank measures its total without a budget; the budget is
set between the two totals: the larger rank alone would decline keys. Every rank must keep the
same keys, and steps replay the same key on both ranks with the reference output.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from tests.distributed._models import CONFIG, VOCAB, TensorParallelMLP, decodes, reference
from tests.distributed._spawn import outcome

TIMEOUT_S = 10.0
SPLIT = 80
"""Rank 0's logits columns; rank 1 holds the other VOCAB - SPLIT."""


class UnevenHead(TensorParallelMLP):
    """The TP shard returning its slice of the logits (a vocab-parallel head split unevenly)."""

    def forward(self, inputs) -> torch.Tensor:
        x = self.emb[inputs.input_ids.long()]
        hidden = x + self.all_reduce(torch.relu(x @ self.w1) @ self.w2)
        cols = slice(0, SPLIT) if self.rank == 0 else slice(SPLIT, VOCAB)
        logits = hidden @ self.head[:, cols]  # this rank's columns: activations sized by its share
        return logits + 0.0 * torch.relu(logits)


def admitted(rank: int, world: int, directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config

    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    parallel = Parallel(tp_group=group, timeout=TIMEOUT_S, failure_timeout=TIMEOUT_S)

    def manager(overrides: dict) -> tuple[Any, Any]:
        model = UnevenHead(rank, world, "functional", group)
        model.rank = rank
        config = load_config(overrides={**CONFIG, **overrides})
        return CaptureManager(model, config, backend="emulated", parallel=parallel, progress=False), model

    probe, _ = manager({})
    total = probe._budget.estimate(probe.config, probe.registry.planned)  # collective: the forwards all-reduce
    totals: list[Any] = [None] * world
    dist.all_gather_object(totals, total, group=group)
    budget = (min(totals) + max(totals)) // 2
    res: dict[str, Any] = {"totals": totals}
    served, model = manager({"capture.memory_budget": budget})
    done = res["capture"] = outcome(lambda: len(served.capture().captured))
    res["captured"] = sorted(str(key) for key in served.registry.captured)
    res["skipped"] = sorted(str(key) for key in served.registry.skipped)
    res["steps"] = []
    if "value" in done:
        for tokens in (1, 2, 4, 8):
            batch = decodes(tokens, 100 + tokens)
            step = outcome(lambda b=batch: served.execute(b).clone())
            if "value" in step:
                expected = reference(batch.input_ids)
                expected = expected[:, :SPLIT] if rank == 0 else expected[:, SPLIT:VOCAB]
                step["match"] = bool(torch.allclose(step.pop("value"), expected, atol=1e-5, rtol=1e-5))
            step["key"] = str(served.last_key)
            res["steps"].append(step)
    return res
