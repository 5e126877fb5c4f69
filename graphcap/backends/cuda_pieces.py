"""`CUDAPieceSession`: a forward recorded as one `torch.cuda.CUDAGraph` per piece, all in the backend's pool.

The rules of `graphcap.backends.pieces` hold; what is particular to CUDA:

- Pieces are captured on the pool's side stream into the backend's pool, so pieces of every
  key share memory like full graphs do. The eager ops between them run eagerly (not
  captured), their own allocations come from the ordinary allocator.
- Nothing outside the pool is kept alive for a graph. An eager op's static result is
  allocated inside the piece after it (a captured `torch.empty_like`, no kernel), and once the
  forward is recorded every tensor a call holds that lives in the pool (its result, and the
  arguments earlier pieces made) becomes an unowned alias: a replay rewrites each of them (the
  piece before the op writes its arguments, the op writes its result) before anything reads it,
  as with a full graph's intermediates. Owning them would pin about 1 MiB per token of an
  8B-shaped model for every piecewise key, memory no later graph could reuse.
- No output is invalidated when another graph replays (the pool reuses the memory for real).
- A piece whose `capture_end` fails is discarded at once (`discard_capture`), so the allocator
  never stays recording to the pool, whatever the torch version.
- At capture time nothing of a piece runs: an eager op called during capture reads memory no
  kernel has written yet (`graphcap.piecewise` says what that allows).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from graphcap.backends.generators import register_generators
from graphcap.backends.pieces import EagerCall, PieceSession, PiecewiseGraph
from graphcap.backends.pool import discard_capture, unowned_alias
from graphcap.outputs import flatten_output

__all__ = ["CUDAPieceSession", "pool_membership", "release_pool_tensors"]


class CUDAPieceSession(PieceSession):
    """One `torch.cuda.CUDAGraph` per piece, all in the backend's pool, on its side stream."""

    def __init__(self, backend: Any, name: str) -> None:
        super().__init__(backend, name)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        self._began = False  # whether the open piece's capture_begin returned
        self._stream_context: Any = None
        self._handle = backend.pool.handle
        self._caller = torch.cuda.current_stream(backend.device)
        self._reserved = torch.cuda.memory_reserved(backend.device)

    def begin_piece(self) -> None:
        stream = self.backend.pool.stream
        stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        self._stream_context = torch.cuda.stream(stream)
        self._stream_context.__enter__()
        graph = torch.cuda.CUDAGraph()
        self._graph, self._began = graph, False
        register_generators(graph, self.backend.generators)  # before capture_begin, on every piece
        graph.capture_begin(pool=self._handle, capture_error_mode=self.backend.capture_error_mode)
        self._began = True

    def _static_result(self, result: torch.Tensor) -> torch.Tensor:
        # The piece has begun: this block comes from the pool, and the capture records no kernel for it.
        return torch.empty_like(result)

    def end_piece(self) -> None:
        graph = self._graph
        if graph is None:
            return
        try:
            graph.capture_end()
        except BaseException as error:
            self._graph = None
            with contextlib.suppress(Exception):
                self._leave_stream()
            if not discard_capture(graph, self.backend.device, self._handle, began=self._began):
                self.backend.restore_generators(error)  # capture_end threw before it ended their capture
            raise
        self._graph = None
        self.graphs.append(graph)
        self._leave_stream()

    def _leave_stream(self) -> None:
        context, self._stream_context = self._stream_context, None
        if context is not None:
            context.__exit__(None, None, None)
            self._caller.wait_stream(self.backend.pool.stream)

    def finish(self, output: Any, input_ptrs: dict[str, int]) -> PiecewiseGraph:
        self.end_piece()
        leaves, rebuild = flatten_output(output, self.name)
        self.backend.synchronize()
        in_pool = pool_membership(self.backend.device, self._handle)
        release_pool_tensors(self.calls, in_pool)
        aliases = [unowned_alias(t) for t in leaves]  # the pool keeps the memory; nothing else needs to
        delta = torch.cuda.memory_reserved(self.backend.device) - self._reserved
        return PiecewiseGraph(
            name=self.name,
            output=rebuild(aliases),
            input_ptrs=input_ptrs,
            memory_bytes=max(0, delta),
            graph_pool=self.backend.pool,
            pieces=[_CUDAPiece(g) for g in self.graphs],
            calls=self.calls,
            leaves=aliases,
            owned=[in_pool(t) for t in leaves],
            invalidates=False,
        )

    def abort(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            with contextlib.suppress(Exception):
                graph.capture_end()
            with contextlib.suppress(Exception):
                self._leave_stream()
            if not discard_capture(graph, self.backend.device, self._handle, began=self._began):
                self.backend.restore_generators()
        with contextlib.suppress(Exception):
            self._leave_stream()
        for done in self.graphs:
            with contextlib.suppress(Exception):
                done.reset()
        self.graphs = []


class _CUDAPiece:
    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph: torch.cuda.CUDAGraph | None = graph

    def replay(self) -> None:
        graph = self.graph
        assert graph is not None  # a released piece is never replayed
        graph.replay()

    def release(self) -> None:
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.reset()


def pool_membership(device: torch.device, handle: Any) -> Callable[[torch.Tensor], bool]:
    """A predicate: does a tensor's storage lie in the allocator segments of pool `handle`?

    Read from `torch.cuda.memory_snapshot()` (each segment names its pool), without the allocation
    traces where torch can leave them out (an engine recording memory history would otherwise have
    the whole trace serialised for every key). When the snapshot cannot say, every tensor counts as
    outside the pool, i.e. is kept owned (correct, only larger).
    """
    try:
        segments = _segments()
    except Exception:
        return lambda tensor: False
    wanted = tuple(handle) if isinstance(handle, (tuple, list)) else handle
    ranges = [
        (s["address"], s["address"] + s["total_size"])
        for s in segments
        if s.get("device", device.index) == device.index and _pool_id(s.get("segment_pool_id")) == wanted
    ]

    def in_pool(tensor: torch.Tensor) -> bool:
        start = tensor.untyped_storage().data_ptr()
        return any(low <= start < high for low, high in ranges)

    return in_pool


def _segments() -> list[dict]:
    """`torch.cuda.memory_snapshot()`, with `include_traces=False` where its signature has it."""
    snapshot = torch.cuda.memory_snapshot
    try:
        takes = "include_traces" in inspect.signature(snapshot).parameters
    except (TypeError, ValueError):
        takes = False
    return snapshot(include_traces=False) if takes else snapshot()


def _pool_id(value: Any) -> Any:
    return tuple(value) if isinstance(value, (tuple, list)) else value


def release_pool_tensors(calls: list[EagerCall], in_pool: Callable[[torch.Tensor], bool]) -> None:
    """Replace every tensor the calls hold that `in_pool` says lives in the pool by an unowned alias.

    Tensors outside the pool (parameters, the KV cache, engine buffers, anything the forward
    captured from outside) stay owned: their owner may drop them, the graph still reads them.
    """
    for call in calls:
        call.args = _aliased(call.args, in_pool)
        call.kwargs = _aliased(call.kwargs, in_pool)
        if in_pool(call.out):
            call.out = unowned_alias(call.out)


def _aliased(value: Any, in_pool: Callable[[torch.Tensor], bool]) -> Any:
    if isinstance(value, torch.Tensor):
        return unowned_alias(value) if in_pool(value) else value
    if isinstance(value, tuple):
        return tuple(_aliased(v, in_pool) for v in value)
    if isinstance(value, list):
        return [_aliased(v, in_pool) for v in value]
    if isinstance(value, dict):
        return {k: _aliased(v, in_pool) for k, v in value.items()}
    return value
