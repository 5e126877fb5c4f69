"""Two data-parallel ranks whose replays both hit a device-side assert (spawned by `_spawn.spawn_world`).

Each rank steps a decode of its own size (rank 0: 2 requests, rank 1: 3), agreed to one key, twice;
the second replay raises the CUDA-style error on both ranks. Returns what each rank's error and
post-mortem file say, as plain data the parent asserts on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.distributed._models import CONFIG

TIMEOUT_S = 30.0


def both_crash(rank: int, world: int, directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config
    from graphcap.models import build_model
    from graphcap.postmortem.recheck import load_postmortem, recheck
    from tests.postmortem_cases import decode, device_asserts

    overrides = {**CONFIG, "report.postmortem": directory, "report.flight_steps": 3, "checks.invariants": "off"}
    config = load_config(overrides=overrides)
    parallel = Parallel(dp_group=dist.group.WORLD, timeout=TIMEOUT_S)
    manager = CaptureManager(build_model(config), config, backend="emulated", parallel=parallel, progress=False)
    manager.capture()
    device_asserts(manager, at=2)
    manager.execute(decode(2 + rank), step=1)
    res: dict[str, Any] = {}
    try:
        manager.execute(decode(2 + rank), step=2)
    except RuntimeError as exc:
        res["raised"] = (type(exc).__name__, exc.args, list(getattr(exc, "__notes__", [])))
    path = Path(directory) / f"graphcap-postmortem.rank{rank}.json"
    document = load_postmortem(path)
    res["file"] = str(path)
    res["rank"], res["world_size"] = document["rank"], document["world_size"]
    res["steps"] = [(s["step"], s["key_text"], s["num_tokens"], s["num_reqs"]) for s in document["steps"]]
    res["holds"] = [c.violation is None for c in recheck(document)]
    return res
