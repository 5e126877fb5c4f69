"""`GraphPool`: the memory a backend's graphs share, and the rule that comes with sharing it.

Graphs captured into one pool reuse one another's memory: captured largest first, each
later graph carves its intermediates, and its output, out of blocks the earlier graphs
freed, and an output is not kept alive after capture (an 8B model's 86 graphs would
otherwise pin 7 GiB of logits). So replaying one graph may overwrite any other graph's
output. The contract every backend keeps: **a returned output is valid until any graph
of the same pool replays** (its own next replay included) or is released. The CUDA
backend gets this from the allocator; the emulated backend reproduces it by invalidating
(NaN for floating point) the last output whenever another graph of the pool replays.

One pool per backend instance; `get_backend(..., share_pool_with=other)` puts two
backends (a target and a draft model) in one pool to share memory, and then one's step
invalidates the other's output. Replays of one pool are serialized by `lock` and must
run on one stream.

The CUDA allocator counts the graphs of each pool handle (`use_count`) and keeps a handle
whose count fell to zero until `empty_cache()` frees it; capturing into it again before that
fails with `use_count > 0` (an INTERNAL ASSERT). So a `GraphPool` counts its live graphs per
handle too, and moves later captures to a fresh handle when the last graph of the current one
is released (after a failed verification, a data-parallel peer's failure, a second capture
pass on one backend).
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch


class _Replayed(Protocol):
    """What the pool needs of a graph that replayed last (a `CapturedGraph`; the pool sits below it)."""

    @property
    def is_released(self) -> bool: ...

    def _invalidate_output(self) -> None: ...


__all__ = ["GraphPool", "discard_capture", "invalidate", "unowned_alias"]


class GraphPool:
    """One memory pool: its handle (CUDA), its capture stream (CUDA), and who replayed last.

    `new_handle` makes a fresh allocator pool (`torch.cuda.graph_pool_handle` on CUDA;
    None on the emulated backend, whose graphs own private memory); `empty_cache` returns
    the memory of a pool whose last graph was released. `rotate()` moves later
    captures to a fresh handle: after a failed capture (whose leftovers may pin the old
    pool, or leave the allocator recording to it), when a backend is reset, and when the
    last live graph of the current handle is released (`hold` / `drop` count them). Graphs
    already captured keep the pool they were captured into until they are released.
    """

    def __init__(
        self,
        device: torch.device,
        new_handle: Callable[[], Any] | None = None,
        stream: Any = None,
        empty_cache: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self._empty_cache = empty_cache  # returns a rotated-away pool's free memory (CUDA)
        self.stream = stream
        """The side stream every capture into this pool runs on (CUDA), or None."""
        self._new_handle = new_handle
        self.handle: Any = new_handle() if new_handle is not None else None
        """The allocator pool id later captures go to (None on the emulated backend)."""
        self.num_rotations = 0
        self.lock = threading.RLock()
        """Held around every replay of the pool's graphs (replays must not overlap)."""
        self._last: weakref.ref[_Replayed] | None = None
        self._live: dict[Any, int] = {}  # live graphs per handle (handles are hashable ids)

    def rotate(self) -> None:
        """Send later captures to a fresh pool; the old one is freed when its graphs are."""
        if self._new_handle is not None:
            self.handle = self._new_handle()
        self.num_rotations += 1

    def hold(self) -> Any:
        """Count one more live graph in the current handle; returns the handle to give to `drop`."""
        handle = self.handle
        self._live[handle] = self._live.get(handle, 0) + 1
        return handle

    def drop(self, handle: Any) -> None:
        """A graph of `handle` was released; the last one of the current handle rotates the pool.

        The allocator would refuse a later capture into a handle whose graphs are all gone
        (its use count is zero until `empty_cache()` frees the pool), so later captures go to
        a fresh handle. Pools without allocator handles (the emulated backend) have nothing
        to rotate.
        """
        left = self._live.get(handle, 0) - 1
        if left > 0:
            self._live[handle] = left
            return
        self._live.pop(handle, None)
        if self._new_handle is not None and handle == self.handle:
            self.rotate()
            if self._empty_cache is not None:  # the old pool is all free now: give it back at once
                with contextlib.suppress(Exception):
                    self._empty_cache()

    def num_live(self, handle: Any = None) -> int:
        """Live graphs counted in `handle` (default: the current one)."""
        return self._live.get(self.handle if handle is None else handle, 0)

    def before_replay(self, graph: _Replayed) -> None:
        """Record that `graph` replays next; the previous graph's output stops being valid."""
        last = self._last() if self._last is not None else None
        if last is not None and last is not graph and not last.is_released:
            last._invalidate_output()
        self._last = weakref.ref(graph)

    def __repr__(self) -> str:
        return f"GraphPool({self.device}, handle={self.handle}, rotations={self.num_rotations})"


def invalidate(output: torch.Tensor) -> None:
    """Overwrite `output` with what a reused block would read as: NaN, or the dtype's extreme.

    Floating and complex outputs become NaN; integers their minimum (a token id no
    vocabulary holds); booleans True.
    """
    with torch.inference_mode():
        if output.is_floating_point() or output.is_complex():
            output.fill_(float("nan"))
        elif output.dtype == torch.bool:
            output.fill_(True)
        else:
            output.fill_(torch.iinfo(output.dtype).min)


def unowned_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as `tensor` that does not keep that memory alive.

    What a CUDA graph returns after capture: the graph writes its output's address on
    every replay whether or not a tensor owns it, so owning it would only keep the block
    out of the pool for later captures. Valid while the memory is (the pool's contract).
    """
    storage = tensor.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    with torch.inference_mode():  # an inference tensor, like the output it stands for
        alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        alias.set_(unowned, tensor.storage_offset(), tensor.size(), tensor.stride())
    return alias


def discard_capture(graph: torch.cuda.CUDAGraph, device: torch.device, handle: Any, *, began: bool = True) -> None:
    """Drop a failed capture: nothing of it stays recording, its use of the pool is released exactly once.

    `began`: whether `capture_begin` returned (the caller tracks it). What is left to undo
    depends on where the capture failed and on the torch version, and is read from the
    allocator rather than assumed:

    - `capture_end` completed (`graph.pool()` works; the forward raised after the capture
      ended cleanly): the graph's own `reset()` releases the pool; nothing else may.
    - the allocator is still recording to the pool (`_cuda_endAllocateToPool` succeeds): torch
      2.11 and earlier throw at `cudaStreamEndCapture` before they stop the recording, or
      `capture_begin` failed after starting it. Ending it here, then releasing the pool's use
      once, is the whole cleanup (`reset()` releases only after a completed capture).
    - the recording already ended (ending it raises) after `capture_begin` returned: torch 2.12
      and 2.13 end the recording inside `capture_end`, then raise, and their `reset()` does not
      release, so it is released here once. Later versions release in `reset()` (PyTorch PR
      190348); for them, and any version not known to need it, nothing more is released: a second
      release could free the memory of graphs still alive in the pool, a missing one only keeps
      the (already rotated-away) pool's memory reserved.

    torch has no Python binding for the pinned host allocator's side of the recording; it stops
    matching allocations once the stream no longer captures.
    """
    try:
        graph.pool()  # raises unless capture_end completed
        completed = True
    except Exception:
        completed = False
    with contextlib.suppress(Exception):
        graph.reset()
    if not completed:
        try:
            torch._C._cuda_endAllocateToPool(device.index, handle)
            still_recording = True
        except Exception:
            still_recording = False  # never began recording, or capture_end ended it before failing
        if still_recording or (began and _reset_keeps_failed_capture()):
            with contextlib.suppress(Exception):
                torch._C._cuda_releasePool(device.index, handle)
    with contextlib.suppress(Exception):  # raises again for a sticky error: the manager reports it
        torch.cuda.synchronize(device)
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()  # what the failed capture held (an OOM's retry needs it)


def _torch_release() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


_TORCH_RELEASE = _torch_release()
_ENDS_BEFORE_RAISING = ((2, 12), (2, 13))
"""torch releases whose `capture_end` ends the allocator's recording, then raises, and whose
`reset()` does not release a failed capture's pool (PyTorch PRs 180395 and 190348)."""


def _reset_keeps_failed_capture() -> bool:
    """Whether this torch leaves the use of a capture that `capture_end` ended but failed to its caller."""
    return _TORCH_RELEASE in _ENDS_BEFORE_RAISING
