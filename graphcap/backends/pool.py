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
whose count fell to zero until `empty_cache()` frees it (the pinned host allocator, which keeps
graph pools too from torch 2.11, until `torch._C._host_emptyCache()`); capturing into it again
before that fails with `use_count > 0` (an INTERNAL ASSERT). So a `GraphPool` counts its live
graphs per handle too, never captures into a handle again once its count fell to zero, and moves
later captures to a fresh handle when the last graph of the current one is released (after a
failed verification, a data-parallel peer's failure, a second capture pass on one backend).

The memory budget's reservation (`capture.memory_budget`, `GraphPool.reserve`) belongs to the
pool, not to a backend: backends sharing a pool reserve once, and the reservation follows the
pool when it rotates (it is given back in the old handle and taken again in the new one), so it
always sits where the next capture allocates.
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class _Replayed(Protocol):
    """What the pool needs of a graph that replayed last (a `CapturedGraph`; the pool sits below it)."""

    @property
    def is_released(self) -> bool: ...

    def invalidate_output(self) -> None: ...


__all__ = ["GraphPool", "Reservation", "discard_capture", "invalidate", "unowned_alias"]

Reserve = Callable[[Any, int], tuple[Callable[[], None], int]]
"""Sets bytes aside in a pool handle: `(handle, num_bytes) -> (give back, device bytes taken)`."""


@dataclass
class Reservation:
    """Bytes set aside in one handle of a pool for later captures (`capture.memory_budget`)."""

    num_bytes: int
    """The bytes asked for (the largest budget of the backends sharing the pool)."""
    handle: Any
    """The allocator pool id holding them (None on the emulated backend: accounted, not allocated)."""
    took: int = 0
    """Device bytes the reservation took when it was made (growth of the allocator's reserved memory)."""
    holders: list[Callable[[], None]] = field(default_factory=list)
    """One call per holder graph, giving its use of `handle` back (none on the emulated backend)."""


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
        reserve: Reserve | None = None,
    ) -> None:
        self.device = device
        self._reserve = reserve  # allocates a reservation in a handle (CUDA); None: accounted only
        self.reservation: Reservation | None = None
        """What `reserve` set aside, always in the current handle (None: nothing)."""
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

    @property
    def reserved_bytes(self) -> int | None:
        """Bytes the reservation sets aside (None: nothing reserved)."""
        return None if self.reservation is None else self.reservation.num_bytes

    def reserve(self, num_bytes: int) -> int:
        """Set `num_bytes` aside in the current handle for later captures; returns the device bytes taken.

        Once per pool: a pool that holds as much already takes nothing (backends sharing a pool reserve
        once), a larger request adds the difference. Held until `release_reservation` (a backend's
        `reset`, `CaptureManager.release()`); a `rotate` moves it to the new handle. Exceptions of the
        allocation (`torch.OutOfMemoryError`) propagate and leave the reservation as it was.
        """
        held = self.reservation
        if held is not None and held.num_bytes >= num_bytes:
            return 0
        extra = num_bytes - (held.num_bytes if held is not None else 0)
        try:
            holder, took = self._reserve(self.handle, extra) if self._reserve is not None else (None, 0)
        except BaseException:
            if self._new_handle is not None and self.num_live() == 0:
                self.rotate()  # the failed holder may have left the handle's use count at zero
                self._empty()
            raise
        if held is None:
            held = self.reservation = Reservation(0, self.handle)
        if holder is not None:
            self.hold()  # counted as a live graph of the handle: the pool does not rotate away from it
            held.holders.append(holder)
        held.num_bytes, held.took = num_bytes, held.took + took
        return took

    def release_reservation(self) -> None:
        """Give the reservation back; its memory returns to the device once the handle's graphs are gone."""
        if self._give_back() and self._new_handle is not None and self.num_live() == 0:
            self.rotate()  # the handle's use count fell to zero: no capture may go there again
            self._empty()

    def rotate(self) -> None:
        """Send later captures to a fresh pool; the old one is freed when its graphs are.

        A reservation follows: given back in the old handle (whose memory returns to the device once
        its graphs are released), then taken again in the new one. If that fails (out of memory, a
        sticky CUDA error) the pool warns and holds no reservation; the caller's own error, if any,
        is not replaced.
        """
        held = self.reservation
        moves = held is not None and bool(held.holders)
        if moves:
            self._give_back()
        if self._new_handle is not None:
            self.handle = self._new_handle()
        self.num_rotations += 1
        if moves and held is not None:
            self._empty()
            try:
                self.reserve(held.num_bytes)
            except Exception as exc:  # any failure: the capture's own error must win
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
                warnings.warn(
                    f"the memory budget's reservation of {held.num_bytes} bytes could not be taken again in the "
                    f"fresh pool ({first}); later captures allocate as they go",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _give_back(self) -> bool:
        """Release the reservation's holders without rotating; whether there was a reservation."""
        held, self.reservation = self.reservation, None
        if held is None:
            return False
        for holder in held.holders:
            with contextlib.suppress(Exception):  # after a sticky CUDA error, reset() raises it again
                holder()
            left = self._live.get(held.handle, 0) - 1
            if left > 0:
                self._live[held.handle] = left
            else:
                self._live.pop(held.handle, None)
        return True

    def _empty(self) -> None:
        if self._empty_cache is not None:
            with contextlib.suppress(Exception):
                self._empty_cache()

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
            self._empty()  # the old pool is all free now: give it back at once

    def num_live(self, handle: Any = None) -> int:
        """Live graphs counted in `handle` (default: the current one)."""
        return self._live.get(self.handle if handle is None else handle, 0)

    def before_replay(self, graph: _Replayed) -> None:
        """Record that `graph` replays next; the previous graph's output stops being valid."""
        last = self._last() if self._last is not None else None
        if last is not None and last is not graph and not last.is_released:
            last.invalidate_output()
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


def discard_capture(graph: torch.cuda.CUDAGraph, device: torch.device, handle: Any, *, began: bool = True) -> bool:
    """Drop a failed capture: nothing of it stays recording, its use of the pool is released exactly once.

    Returns whether `capture_end` had completed (when it had not, the CUDA generators are still in
    capture mode: `graphcap.backends.cuda_recovery.restore_generators`).

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

    The pinned host allocator (torch 2.11 and later keep graph pools there too) is not undone:
    torch has no Python binding that ends its side of the recording, and a `capture_end` that
    raises before its device side ends (2.11) leaves the host side recording too. Its filter
    then compares the capture id of a graph that no longer exists, which matches no later
    allocation only as long as that id is not reused; the host entries of released handles are
    erased by `torch._C._host_emptyCache()` alone (the CUDA backend calls it before each
    capture). graphcap never captures into a handle again after a failure (it rotates), so the
    host side's `use_count > 0` assertion is not reached.
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
    return completed


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
