"""`torch.cuda.is_current_stream_capturing()` on the emulated backend: True while it records, False elsewhere.

CUDA engines guard their capture-only code with it (vLLM's and SGLang's custom all-reduce, asserts that
a warmup is not a capture). A CPU-only build of torch has no CUDA runtime to ask and raises
(`RuntimeError`) instead of answering, so such a guard failed at the first warmup on the emulated backend.

While any `EmulatedBackend` lives (`hold` from its construction, `release` when it is garbage-collected),
both module attributes code reaches the function by (`torch.cuda` and `torch.cuda.graphs`) answer:
True inside `stream_capturing()` (the tape's recording), else torch's own answer, or False where torch
raises for want of a CUDA runtime (CUDA's answer on a stream that is not capturing). When the last
backend is gone torch's own function is put back, so code that never makes one sees torch unchanged.
The swap is process-wide, like the capture mode of a CUDA stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["StreamAnswer", "stream_capturing"]

_lock = threading.Lock()
_holders = 0
_recording = 0  # stream_capturing() contexts open (a recording)
_saved: tuple[Callable[[], bool], Callable[[], bool]] | None = None  # torch's own, while ours is installed


def _answer() -> bool:
    if _recording:
        return True
    own = _saved[0] if _saved is not None else None
    if own is None:
        return False
    try:
        return own()
    except RuntimeError:  # a CPU-only build of torch: no CUDA runtime, so no stream is capturing
        return False


def _hold() -> None:
    global _holders, _saved
    with _lock:
        if _holders == 0:
            graphs = torch.cuda.graphs
            _saved = torch.cuda.is_current_stream_capturing, graphs.is_current_stream_capturing
            torch.cuda.is_current_stream_capturing = graphs.is_current_stream_capturing = _answer
        _holders += 1


def _release() -> None:
    global _holders, _saved
    with _lock:
        _holders -= 1
        if _holders or _saved is None:
            return
        graphs = torch.cuda.graphs
        if torch.cuda.is_current_stream_capturing is _answer:  # not if someone swapped in their own since
            torch.cuda.is_current_stream_capturing = _saved[0]
        if graphs.is_current_stream_capturing is _answer:
            graphs.is_current_stream_capturing = _saved[1]
        _saved = None


class StreamAnswer:
    """One holder of the answer (an `EmulatedBackend`'s): `hold()` once, `release()` once (idempotent)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = False

    def hold(self) -> None:
        if not self._held:
            _hold()
            self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            _release()


@contextmanager
def stream_capturing() -> Iterator[None]:
    """`torch.cuda.is_current_stream_capturing()` answers True inside (a recording), as on a capturing CUDA stream.

    Installs the answer for its duration too (restored on every exit when no backend holds it)."""
    global _recording
    _hold()
    with _lock:
        _recording += 1
    try:
        yield
    finally:
        with _lock:
            _recording -= 1
        _release()
