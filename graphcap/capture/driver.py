"""`run_pass`: one capture pass, end to end, for `capture()` and each `capture_pending()` key.

The pass's one owner: it splits the keys by the memory budget, freezes GC and sets the
persistent block tables aside for the pass, empties the cache before the first graph of a pool,
holds the budget's reservation, runs the keys (`CapturePass.run`: preflight, warmups, record and
verify each), and hands what passed to the live graphs (`LiveGraphs.install`). It does not decide
which keys (the manager and `LazyCapture` do) and keeps no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from tqdm.contrib.logging import logging_redirect_tqdm

from graphcap.capture.lifecycle import LiveGraphs
from graphcap.capture.runner import CapturePass, gc_frozen
from graphcap.keys import GraphKey
from graphcap.memory.budget import MemoryBudget
from graphcap.report import GraphRecord

__all__ = ["run_pass"]


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

    GC is frozen and the block tables set aside (`set_aside()`) meanwhile; the budget is reserved in
    the pool once (`LiveGraphs.reserve`). Returns every key's record, in `keys` order, and the
    device memory the capture added. On an exception the graphs of `keys` are released, those
    kept before stay.
    """
    backend = job.backend
    if not keys:  # a lazy capture(): nothing to capture now, the budget reserved for later
        live.reserve(budget)
        return [], 0
    admitted, declined = budget.split(job.config, keys, job.registry.captured)
    with gc_frozen(), logging_redirect_tqdm(), set_aside():
        if not live.graphs:
            backend.empty_cache()  # once per pass; the graphs then share the pool
        live.reserve(budget)
        memory_before = backend.memory_in_use()
        records, graphs = job.run(admitted, context=context, progress=progress) if admitted else ([], {})
    live.install(records + declined, graphs)
    order = {key: i for i, key in enumerate(keys)}
    records = sorted(records + declined, key=lambda record: order[record.key])
    return records, max(0, backend.memory_in_use() - memory_before)
