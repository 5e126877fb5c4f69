"""How multi-rank runs start their ranks: forked from a server that has imported torch and graphcap.

Each rank of a gloo world, spawned, is a fresh interpreter that imports torch and graphcap again
(about 2 s of CPU a rank). `rank_context()` is multiprocessing's forkserver context with those
modules preloaded: the server imports them once and runs nothing else (no thread pool, no
process group, no CUDA context), so a rank forked from it starts as fresh as a spawned one.
Targets must be importable module-level functions, as with spawn. Not imported by
`graphcap.testing`: import it from here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRELOAD", "rank_context"]

PRELOAD = ["torch", "torch.distributed", "numpy", "graphcap", "graphcap.manager", "graphcap.distributed"]
"""What the fork server imports once; every rank forked from it starts with these loaded."""


def rank_context() -> Any:
    """The forkserver multiprocessing context with `PRELOAD` preloaded (set before the server starts)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
