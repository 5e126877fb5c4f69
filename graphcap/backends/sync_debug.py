"""CUDA's sync-debug mode: turned on by graphcap's checks, and why it is not turned on beside an engine's threads.

`torch.cuda.set_sync_debug_mode("error")` makes any synchronizing CUDA call (`.item()`, `.cpu()`,
`.tolist()`, blocking host copies, `Stream.synchronize()`) raise. The mode is **process-wide**:
torch keeps it in one static state, not per thread, so while it is on, a synchronizing call in
*any* thread of the process raises, an engine's output or scheduler thread included. graphcap
turns it on in the preflight of each key (the first, checked warmup on CUDA), in the plain
warmups with `checks.sync_debug: true`, and in `check_capture_safe` on a GPU.

Beside an engine's threads, i.e. during `CaptureManager.capture_pending` (lazy capture in a
serving engine: `beside_engine_threads`), the preflight does not turn it on: the unsafe-op table
still names what it knows, and a sync it misses still fails the capture, where CUDA reports it
as an invalidated capture. `checks.sync_debug: true` (`get_backend(..., sync_debug=True)`) is the
explicit opt-in that turns it on there too, for every thread, while each key is warmed up.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from graphcap.backends.locations import traceback_location
from graphcap.errors import CaptureUnsafeError

__all__ = [
    "SYNC_DEBUG_TEXT",
    "beside_engine_threads",
    "engine_threads_may_run",
    "sync_debug_errors",
    "sync_debug_off",
    "sync_error",
]

SYNC_DEBUG_TEXT = "called a synchronizing CUDA operation"
_SYNC_REASON = (
    "it synchronizes the host with the GPU (torch.cuda.set_sync_debug_mode('error') caught it), "
    "which a CUDA graph cannot hold"
)
_SYNC_FIX = "Keep the data on the device inside the forward: no .item(), host copies or waits"
_beside = threading.local()


def sync_error(op: str, location: str) -> CaptureUnsafeError:
    """The `CaptureUnsafeError` for a sync the sync-debug mode caught in `op` at `location`."""
    return CaptureUnsafeError(op, location, _SYNC_REASON, _SYNC_FIX)


@contextlib.contextmanager
def beside_engine_threads() -> Iterator[None]:
    """graphcap's work in this thread runs beside the engine's other threads (lazy capture in a serving engine)."""
    _beside.depth = getattr(_beside, "depth", 0) + 1
    try:
        yield
    finally:
        _beside.depth -= 1


def engine_threads_may_run() -> bool:
    """Whether this thread is inside `beside_engine_threads`."""
    return getattr(_beside, "depth", 0) > 0


@contextlib.contextmanager
def sync_debug_errors(enabled: bool) -> Iterator[None]:
    """CUDA: run under `set_sync_debug_mode("error")`; a sync becomes `CaptureUnsafeError` naming the line.

    Process-wide: while it is on, a sync in any thread raises (see the module). Restores the
    previous mode on every exit path. A no-op when `enabled` is false.
    """
    if not enabled:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        if SYNC_DEBUG_TEXT not in str(exc) or isinstance(exc, CaptureUnsafeError):
            raise
        raise sync_error("a synchronizing CUDA operation", traceback_location(exc.__traceback__)) from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def sync_debug_off() -> Iterator[None]:
    """CUDA's sync-debug mode off (0) for the enclosed code; the previous mode back on every exit path.

    Nothing to do while CUDA is not initialised: then no mode was set.
    """
    if not torch.cuda.is_initialized():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    if previous == 0:
        yield
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
