"""Spawn a gloo world of ranks under a wall-clock limit; every rank's result and exit code checked.

`spawn_world(target, world_size, directory)` starts `world_size` processes, each of which
initialises a gloo process group on a file store under `directory`, runs `target(rank,
world_size, directory)` (a module-level function, so spawn can import it) and pickles the
dict it returns to `rank{N}.pkl` (a traceback instead when it raised). The parent waits at most
`timeout` seconds for the whole world, kills what still runs, and fails the test naming the
hung ranks and the exit codes unless every rank exited as expected (0, or the code in
`exits`, e.g. -9 for a rank that kills itself) and wrote its result. Ranks leave with
`os._exit`: a gloo thread still blocked in an abandoned collective would hold a normal exit.

Ranks start from `graphcap.testing.ranks.rank_context()`: multiprocessing's forkserver with torch and graphcap preloaded, so a
rank is a fork of a process that has imported them and run nothing else (no thread pool, no
process group), as fresh as a spawned interpreter, without paying the imports again for every rank
of every world (about 2 s of CPU each).
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from graphcap.testing.ranks import rank_context

PG_TIMEOUT_S = 60.0
"""The process group's own timeout (collectives inside the model): a test that relies on it is wrong."""


def spawn_world(
    target: Callable[[int, int, str], dict],
    world_size: int,
    directory: Path,
    *,
    timeout: float = 240.0,
    exits: Mapping[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Every rank's result (None for a rank expected to die before writing one); fails the test otherwise."""
    exits = dict(exits or {})
    ctx = rank_context()
    procs = [
        ctx.Process(target=_rank_main, args=(target, rank, world_size, str(directory)), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    codes = [proc.exitcode for proc in procs]
    expected = [exits.get(rank, 0) for rank in range(world_size)]
    if hung or codes != expected:
        pytest.fail(f"world of {world_size}: hung ranks {hung} (killed after {timeout:g} s), exit codes {codes}, "
                    f"expected {expected}{_errors(directory, world_size)}")  # fmt: skip
    results = []
    for rank in range(world_size):
        path = directory / f"rank{rank}.pkl"
        if not path.exists():
            if rank in exits:
                results.append(None)
                continue
            pytest.fail(f"rank {rank} of {world_size} wrote no result")
        result = pickle.loads(path.read_bytes())
        if "error" in result:
            pytest.fail(f"rank {rank} of {world_size} raised:\n{result['error']}")
        results.append(result)
    return results


def _errors(directory: Path, world_size: int) -> str:
    found = []
    for rank in range(world_size):
        path = directory / f"rank{rank}.pkl"
        if path.exists() and "error" in (result := pickle.loads(path.read_bytes())):
            found.append(f"\nrank {rank} raised:\n{result['error']}")
    return "".join(found)


def _rank_main(target: Callable[[int, int, str], dict], rank: int, world_size: int, directory: str) -> None:
    out = Path(directory)
    try:
        torch.set_num_threads(1)  # several ranks share two cores
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = target(rank, world_size, directory)
    except BaseException:
        result = {"error": traceback.format_exc()}
    try:
        tmp = out / f"rank{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, out / f"rank{rank}.pkl")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run `fn()`: {"value": ...} or {"error": type name, "message": text, "seconds": time to fail}."""
    start = time.perf_counter()
    try:
        return {"value": fn()}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
