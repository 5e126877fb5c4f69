"""Data-parallel ranks that load different configs: each must refuse, naming the differing keys.

`mismatched_world(world_size, directory)` spawns one gloo rank per process (a file store under
`directory`); rank 0 plans sizes up to 8 tokens, the others up to 4 and their report paths
differ too (a per-rank key, allowed). Each rank builds a `CaptureManager` and reports what it
raised. Used by `tools/reliability.py`; `tests/distributed` checks the same rule in its world.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["mismatched_world"]

_TIMEOUT_S = 120.0


def mismatched_world(world_size: int, directory: str | Path) -> list[dict[str, Any]]:
    """Every rank's outcome: `{"rank", "keys", "message"}` (keys: the problems' dotted keys)."""
    from graphcap.testing.ranks import rank_context

    directory = Path(directory)
    ctx = rank_context()
    procs = [ctx.Process(target=_rank, args=(r, world_size, str(directory)), daemon=True) for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + _TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    results = []
    for rank in range(world_size):
        path = directory / f"rank{rank}.pkl"
        results.append(pickle.loads(path.read_bytes()) if path.exists() else {"rank": rank, "error": "no result"})
    return results


def _rank(rank: int, world_size: int, directory: str) -> None:
    result: dict[str, Any] = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        from graphcap import CaptureManager, ConfigError, Parallel
        from graphcap.models import build_model
        from graphcap.testing import make_config

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{directory}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=_TIMEOUT_S),
        )
        sizes = [2, 4, 8] if rank == 0 else [2, 4]
        config = make_config({"capture.sizes": sizes, "report.path": f"{directory}/rank{rank}.json"})
        try:
            CaptureManager(
                build_model(config), config, parallel=Parallel(dp_group=dist.group.WORLD, timeout=60.0), progress=False
            )
            result.update(keys=[], message="")
        except ConfigError as exc:
            result.update(keys=[p.key for p in exc.problems], message=str(exc))
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        tmp = Path(directory) / f"rank{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, Path(directory) / f"rank{rank}.pkl")
        os._exit(0)  # gloo threads would hold interpreter teardown
