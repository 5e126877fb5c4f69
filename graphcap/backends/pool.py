"""`GraphPool`: the memory a backend's graphs share, and the rule that comes with sharing it.

Graphs captured into one pool reuse one another's memory: captured largest first, each
later graph carves its intermediates, and its output, out of blocks the earlier graphs
freed, and an output is not kept alive after capture (S3: an 8B model's 86 graphs would
otherwise pin 7 GiB of logits). So replaying one graph may overwrite any other graph's
output. The contract every backend keeps: **a returned output is valid until any graph
of the same pool replays** (its own next replay included) or is released. The CUDA
backend gets this from the allocator; the emulated backend reproduces it by invalidating
(NaN for floating point) the last output whenever another graph of the pool replays.

One pool per backend instance; `get_backend(..., share_pool_with=other)` puts two
backends (a target and a draft model) in one pool to share memory, and then one's step
invalidates the other's output. Replays of one pool are serialized by `lock` and must
run on one stream.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from graphcap.backends.graph import CapturedGraph

__all__ = ["GraphPool", "discard_capture", "invalidate", "unowned_alias"]


class GraphPool:
    """One memory pool: its handle (CUDA), its capture stream (CUDA), and who replayed last.

    `new_handle` makes a fresh allocator pool (`torch.cuda.graph_pool_handle` on CUDA;
    None on the emulated backend, whose graphs own private memory). `rotate()` moves later
    captures to a fresh handle: after a failed capture (whose leftovers may pin the old
    pool, C1/C2) and when a backend is reset. Graphs already captured keep the pool they
    were captured into until they are released.
    """

    def __init__(
        self,
        device: torch.device,
        new_handle: Callable[[], Any] | None = None,
        stream: Any = None,
    ) -> None:
        self.device = device
        self.stream = stream
        """The side stream every capture into this pool runs on (CUDA), or None."""
        self._new_handle = new_handle
        self.handle: Any = new_handle() if new_handle is not None else None
        """The allocator pool id later captures go to (None on the emulated backend)."""
        self.num_rotations = 0
        self.lock = threading.RLock()
        """Held around every replay of the pool's graphs (replays must not overlap)."""
        self._last: weakref.ref[CapturedGraph] | None = None

    def rotate(self) -> None:
        """Send later captures to a fresh pool; the old one is freed when its graphs are."""
        if self._new_handle is not None:
            self.handle = self._new_handle()
        self.num_rotations += 1

    def before_replay(self, graph: CapturedGraph) -> None:
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


def discard_capture(graph: torch.cuda.CUDAGraph, device: torch.device, handle: Any) -> None:
    """Drop a failed capture so nothing of it stays registered or recording (C2).

    `capture_end` throws at `cudaStreamEndCapture` for a capture CUDA invalidated, before
    it stops the allocator recording to the pool, and `reset()` releases the pool only
    after a completed capture: end the recording and release the pool's use here. The
    release happens only when ending succeeded (so this capture's use was still counted):
    a wrong release could free the memory of graphs still alive in the pool.
    """
    try:
        graph.pool()  # raises unless capture_end completed
        ended = True
    except Exception:
        ended = False
    with contextlib.suppress(Exception):
        graph.reset()
    if not ended:
        try:
            torch._C._cuda_endAllocateToPool(device.index, handle)
        except Exception:
            pass  # never began recording, or capture_end ended it before failing
        else:
            with contextlib.suppress(Exception):
                torch._C._cuda_releasePool(device.index, handle)
    with contextlib.suppress(Exception):  # raises again for a sticky error: the manager reports it
        torch.cuda.synchronize(device)
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()  # what the failed capture held (an OOM's retry needs it)
