"""GC held still while graphcap captures: a collection in the middle of a capture could free tensors a graph records.

Two holds, one per way of capturing:

- `gc_frozen(after=1)` around an upfront pass: one full collection before a CUDA pass (as torch's and
  vLLM's captures start with one: dead cycles holding device memory go first; an emulated pass has
  none to free and skips it), then GC off until the
  pass ends, then a collection of the young generations (what the pass made).
- `gc_paused()` around one key of a lazy `capture_pending` call, which must fit a gap of milliseconds
  in an engine's serving loop: GC off for the key, no collection before it (a full collection of an
  engine's heap of millions of objects takes far longer than the gap), and after it a collection of
  the youngest generation only, which holds what the key's capture made (GC was off since it began).

Holds nest: only the outermost one of the process sets GC up and restores it. graphcap keeps its own
count (`depth()`) rather than asking the interpreter (`gc.get_freeze_count()` walks the frozen heap on
Python 3.11), and never freezes the heap: a heap the engine froze itself (`gc.freeze()`) stays frozen,
and one it did not is never left frozen.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["depth", "gc_frozen", "gc_paused"]

_lock = threading.Lock()
_depth = 0  # holds open in this process (GC's state is process-wide, so is the count)
_was_enabled = True  # GC's state when the outermost hold began


def depth() -> int:
    """Holds open in this process (0: GC is as the engine left it)."""
    return _depth


@contextmanager
def gc_frozen(after: int = 1, *, collect_first: bool = True) -> Iterator[None]:
    """A full collection (`collect_first`), then GC off for an upfront capture pass; restored on every
    exit path.

    The collection first frees dead cycles that hold device memory before the graphs take theirs: a
    CUDA pass wants it; the emulated backend has no device memory to free, so its passes skip it (on
    a test process's or an engine's heap it cost a quarter of a pass).

    The collection after the pass walks generations up to `after`, by default the young ones
    only: everything the pass made is young (GC was off), and walking the unchanged old heap again
    costs a third of a re-capture (`tools/bench_capture.py --recapture --gc-full` compares `after=2`).
    Inside another hold: nothing (the outer one collects).
    """
    with _held(before=2 if collect_first else None, after=after):
        yield


@contextmanager
def gc_paused() -> Iterator[None]:
    """GC off for one lazily captured key, with no collection before; restored on every exit path.

    After it, the youngest generation only is collected: what the key's capture made. Inside
    another hold: nothing.
    """
    with _held(before=None, after=0):
        yield


@contextmanager
def _held(*, before: int | None, after: int) -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        outermost = _depth == 0
        _depth += 1
        if outermost:
            _was_enabled = gc.isenabled()
            gc.disable()  # before the collection: nothing may start one between the two
    try:
        if outermost and before is not None:
            gc.collect(before)
        yield
    finally:
        with _lock:
            _depth -= 1
            last = _depth == 0
            if last and _was_enabled:
                gc.enable()
        if last:
            gc.collect(after)
