"""`run_pass`: one capture pass, end to end, for `capture()` and each `capture_pending()` key.

The pass's one owner: it splits the keys by the memory budget, holds GC still (`gc_hold`) and sets the
persistent block tables aside for the pass, empties the cache before the first graph of a pool,
holds the budget's reservation, runs the keys (`CapturePass.run`: preflight, warmups, record and
verify each), and hands what passed to the live graphs (`LiveGraphs.install`). It does not decide
which keys (the manager and `LazyCapture` do) and keeps no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from graphcap.backends import GraphBackend
from graphcap.capture.gc_hold import gc_frozen
from graphcap.capture.lifecycle import LiveGraphs
from graphcap.capture.runner import CapturePass
from graphcap.config import CaptureConfig
from graphcap.distributed.admission import agreed_admission
from graphcap.keys import GraphKey
from graphcap.memory.budget import MemoryBudget
from graphcap.report import GraphRecord

__all__ = ["EMULATED_CAPTURE_THREADS", "run_pass"]

EMULATED_CAPTURE_THREADS = 1
"""torch CPU threads while the emulated backend captures, unless `capture.num_threads` says otherwise: a
pass of the default config took 2.4 s on one thread against 16.3 s on two on the shared 2-core reference
VM (docs/BENCHMARKS.md, "Capture threads on the emulated backend")."""


def run_pass(
    job: CapturePass,
    live: LiveGraphs,
    keys: list[GraphKey],
    *,
    budget: MemoryBudget,
    set_aside: Callable[[], AbstractContextManager],
    context: Callable[[], AbstractContextManager],
    progress: bool | None,
) -> tuple[list[GraphRecord], int]:
    """Capture and verify `keys` with `job` within `budget`, and keep what passed in `live`.

    GC is held still (`gc_frozen`; inside a lazy key's `gc_paused` it does nothing) and the block
    tables set aside (`set_aside()`) meanwhile; the budget is reserved in the pool once
    (`LiveGraphs.reserve`); the backend empties the allocator's cache before each capture
    (`GraphBackend.capture`). Returns every key's record, in `keys` order, and the
    device memory the capture added. On an exception the graphs of `keys` are released, those
    kept before stay.
    """
    backend = job.backend
    if not keys:  # a lazy capture(): nothing to capture now, the budget reserved for later
        live.reserve(budget)
        return [], 0
    admitted, declined = budget.split(job.config, keys, job.registry.captured)
    if job.failures.peers is not None and budget.limit is not None:  # every rank keeps a key only if every rank can
        admitted, declined = agreed_admission(job.failures.peers, keys, admitted, declined)
    collect_first = backend.name == "cuda"  # dead cycles holding device memory; the emulated backend has none
    with (
        gc_frozen(collect_first=collect_first),
        logging_redirect_tqdm(),
        set_aside(),
        _capture_threads(backend, job.config),
    ):
        live.reserve(budget)  # the backend empties the allocator's cache before each capture itself
        memory_before = backend.memory_in_use()
        records, graphs = job.run(admitted, context=context, progress=progress) if admitted else ([], {})
    live.install(records + declined, graphs)
    order = {key: i for i, key in enumerate(keys)}
    records = sorted(records + declined, key=lambda record: order[record.key])
    return records, max(0, backend.memory_in_use() - memory_before)


@contextmanager
def _capture_threads(backend: GraphBackend, config: CaptureConfig) -> Iterator[None]:
    """torch's CPU threads set for an emulated pass (`capture.num_threads`, default `EMULATED_CAPTURE_THREADS`)
    and restored after it; another backend's passes keep torch's setting."""
    if backend.name != "emulated":
        yield
        return
    wanted = config.capture.num_threads or EMULATED_CAPTURE_THREADS
    was = torch.get_num_threads()
    if wanted == was:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(was)
