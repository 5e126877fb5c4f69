"""A seeded randomized run of two data-parallel ranks, one misbehaving at random points (`_spawn.spawn_world`).

Both ranks draw the same events from the seed in `seed.txt`: a step with random sizes (0: an idle
rank), a step whose batch one rank has refused before or after the agreement, a lifecycle call
one rank makes alone while its peer steps, a release and re-capture by both. After every event
both ranks run the same probe step. Each rank returns what every event and probe did.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import numpy as np

from tests.distributed._collective_worker import _break_seq_lens, _step
from tests.distributed._models import CONFIG, GatherMLP
from tests.distributed._spawn import outcome

TIMEOUT_S = 10.0
EVENTS = ("step", "refused", "refused_after", "lone_release", "lone_reset", "lone_capture", "release_all")


def machine(rank: int, world: int, directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config

    seed, count = (int(word) for word in (Path(directory) / "seed.txt").read_text().split())
    rng = np.random.default_rng(seed)
    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = GatherMLP(group, world)
    config = load_config(overrides={**CONFIG, "checks.sample_every": 3})
    manager = CaptureManager(
        model, config, backend="emulated", parallel=Parallel(dp_group=group, timeout=TIMEOUT_S), progress=False
    )
    manager.capture()
    graphs = len(manager.graphs)
    events = []
    for number in range(1, count + 1):
        kind = EVENTS[int(rng.integers(len(EVENTS)))]
        lone = int(rng.integers(world))
        sizes = [int(size) for size in rng.integers(0, 13, world)]
        tokens = sizes[rank] or (1 if kind.startswith("refused") and rank == lone else 0)
        mine = rank == lone
        if kind == "step":
            done = _step(manager, model, tokens, number * 10 + rank, step=number)
        elif kind == "refused":
            done = _step(manager, model, tokens, number * 10 + rank, step=number, bad_block=mine)
        elif kind == "refused_after":
            model.on_prepare = _break_seq_lens if mine else None
            done = _step(manager, model, tokens, number * 10 + rank, step=number)
            model.on_prepare = None
        elif kind.startswith("lone_"):
            call = {"lone_release": manager.release, "lone_reset": manager.reset, "lone_capture": manager.capture}
            done = outcome(call[kind]) if mine else _step(manager, model, tokens, number * 10 + rank, step=number)
            done.pop("value", None)
        else:
            done = outcome(lambda: (manager.release(), len(manager.capture().captured))[1])
        done.update(kind=kind, lone=lone, graphs=len(manager.graphs), tokens=tokens)
        done["probe"] = _step(manager, model, 3, 7 + number, step=number)
        events.append(done)
    return {"events": events, "graphs": graphs, "sampled": manager._sampler.checked}
