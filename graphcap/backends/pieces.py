"""Piecewise graphs: a forward cut at every `eager_op` call into pieces, with the ops run eagerly between.

A `PieceSession` records one forward: it begins a piece, and at each `eager_op` call
(`graphcap.piecewise`) it ends the piece, runs the op eagerly on the piece's tensors, keeps
the op's result as a static tensor, and begins the next piece, which reads that result. A
`PiecewiseGraph` replays piece, op, piece, ... with no Python forward: each op is called
again with its captured arguments (tensors are static; non-tensor arguments frozen) and
writes into its static result (in place when it takes `out=`, else by one copy per call).

Each backend records a piece its own way (`EmulatedPieceSession`: one aten tape per piece;
`graphcap.backends.cuda_pieces.CUDAPieceSession`: one `torch.cuda.CUDAGraph` per piece, all in
the backend's pool). The
rules the manager relies on are the same: tensors one piece makes that a later piece, an op
or the forward's result reads are rewritten in place by every replay; request metadata (whose
shape changes from step to step) is read only by the ops, through `current_inputs()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphcap.backends.compiled import eager_only
from graphcap.backends.graph import CapturedGraph
from graphcap.backends.locations import user_location as _user_location
from graphcap.backends.pool import invalidate
from graphcap.backends.preflight import in_preflight, unsafe_op_checker
from graphcap.backends.tape import TapeRecorder, compile_tape
from graphcap.errors import CaptureError
from graphcap.fields import REQUEST_FIELDS
from graphcap.outputs import flatten_output
from graphcap.piecewise import current_inputs
from graphcap.torch_modes import no_torch_function

__all__ = [
    "EagerCall",
    "EmulatedPieceSession",
    "PieceSession",
    "PiecewiseGraph",
    "forbidden_reads",
    "request_views",
]


@dataclass(eq=False)
class EagerCall:
    """One `eager_op` call between two pieces: the op, its captured arguments and its static result."""

    op: Any
    """The `graphcap.piecewise.EagerOp`."""
    args: tuple
    kwargs: dict
    out: torch.Tensor
    """The static result later pieces read; every replay rewrites it."""

    def run(self) -> None:
        """Run the op eagerly into `out` (in place with `out=`, else by one copy)."""
        with torch.inference_mode():
            if self.op.takes_out:
                result = self.op.fn(*self.args, **self.kwargs, out=self.out)
                with no_torch_function():  # the op ran under the engine's modes; graphcap's check needs none
                    moved = result is not None and result.data_ptr() != self.out.data_ptr()
                if moved:
                    raise CaptureError(
                        f"{self.op!r} was given out= and returned another tensor; the next piece reads out, "
                        "so write the result into it (and return it, or None)"
                    )
                return
            result = self.op.fn(*self.args, **self.kwargs)
            with no_torch_function():
                _check_result(self.op, result, like=self.out)
                self.out.copy_(result)


@dataclass(eq=False, repr=False, kw_only=True)
class PiecewiseGraph(CapturedGraph):
    """A forward captured as pieces with eager ops between them; replays them in order.

    `num_pieces` graphs (tapes on the emulated backend), `calls` the eager ops between them.
    The output contract is a full graph's: valid until any graph of the pool replays.
    """

    pieces: list[Any] = field(default_factory=list, repr=False)
    calls: list[EagerCall] = field(default_factory=list, repr=False)
    leaves: list[torch.Tensor] = field(default_factory=list, repr=False)
    owned: list[bool] = field(default_factory=list, repr=False)
    """Per output tensor: whether pool replays may overwrite it (not a view of a persistent tensor)."""
    invalidates: bool = True
    """Whether another graph's replay fills the owned outputs with NaN (the emulation of a shared pool;
    on CUDA the pool itself reuses the memory, and a fill would cost a kernel per switch of graph)."""

    @property
    def num_pieces(self) -> int:
        return len(self.pieces)

    @property
    def copies_per_replay(self) -> int:
        """Result copies one replay takes: one per call of an eager op without an `out=` parameter."""
        return sum(not call.op.takes_out for call in self.calls)

    def _replay(self) -> None:
        calls = self.calls
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(calls):
                calls[i].run()

    def _release(self) -> None:
        for piece in self.pieces:
            piece.release()
        self.pieces, self.calls, self.leaves = [], [], []

    def invalidate_output(self) -> None:
        if not self.invalidates:
            return
        for leaf, owned in zip(self.leaves, self.owned):
            if owned:
                invalidate(leaf)


class PieceSession:
    """Records one forward as pieces; `cut` is what an `eager_op` call does during the capture."""

    def __init__(self, backend: Any, name: str) -> None:
        self.backend = backend
        self.name = name
        self.calls: list[EagerCall] = []
        self._uncompiled: list[list[str]] = []  # per piece: compiled functions it ran uncompiled

    def cut(self, op: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        passed = {id(t) for t in _tensors((args, kwargs))}
        for name, view in request_views(current_inputs()).items():
            if id(view) in passed:
                raise CaptureError(
                    f"{op!r} is passed inputs.{name}: a replay calls it again with the arguments captured "
                    "here, and request metadata changes shape from step to step. Read it inside the op "
                    "through graphcap.current_inputs() instead"
                )
        self.end_piece()
        with torch.inference_mode():
            result = op.fn(*args, **kwargs)
        _check_result(op, result)
        self.begin_piece()
        static = self._static_result(result)
        self.calls.append(EagerCall(op, args, dict(kwargs), static))
        return static

    def _static_result(self, result: torch.Tensor) -> torch.Tensor:
        """The tensor that holds the op's result for the pieces after it (called with the next piece begun)."""
        return result

    def begin_piece(self) -> None:
        raise NotImplementedError

    def end_piece(self) -> None:
        raise NotImplementedError

    def finish(self, output: Any, input_ptrs: dict[str, int]) -> PiecewiseGraph:
        raise NotImplementedError

    def abort(self) -> None:
        """Drop everything recorded after a failure (the backend rotates its pool)."""


class EmulatedPieceSession(PieceSession):
    """One aten tape per piece; the tapes are compiled once the forward is done."""

    def __init__(self, backend: Any, name: str) -> None:
        super().__init__(backend, name)
        self.records: list[list] = []
        self._stack: contextlib.ExitStack | None = None

    def begin_piece(self) -> None:
        recorder = TapeRecorder(self.backend.device)
        self._stack = contextlib.ExitStack()
        self._uncompiled.append(self._stack.enter_context(eager_only()))
        self._stack.enter_context(unsafe_op_checker(self.backend.device, recorder))
        self.records.append(recorder.records)

    def end_piece(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def finish(self, output: Any, input_ptrs: dict[str, int]) -> PiecewiseGraph:
        self.end_piece()
        leaves, rebuild = flatten_output(output, self.name)
        made = [_made(records) for records in self.records]
        # What each piece must leave behind: its tensors a later piece, an op or the result reads.
        read_later: list[set[int]] = [set() for _ in self.records]
        for piece in range(len(self.records)):
            later = [rec for records in self.records[piece + 1 :] for rec in records]
            ids = {id(t) for _, args, kwargs, _ in later for t in _tensors((args, kwargs))}
            ids |= {id(t) for call in self.calls[piece:] for t in _tensors((call.args, call.kwargs))}
            ids |= {id(t) for t in leaves}
            read_later[piece] = ids
        pieces, peak, persistent = [], 0, {}
        for piece, records in enumerate(self.records):
            exports = [t for i, t in made[piece].items() if i in read_later[piece]]
            tape = compile_tape(records, exports)
            pieces.append(_TapePiece(tape, exports))
            peak = max(peak, tape.peak_bytes)
            for t, slot in zip(exports, tape.result_slots):
                if slot >= 0:
                    persistent[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            records.clear()  # capture-time intermediates die here
        for call in self.calls:
            persistent[call.out.untyped_storage().data_ptr()] = call.out.untyped_storage().nbytes()
        made_ids = set().union(*(set(m) for m in made)) if made else set()
        owned = [id(t) in made_ids or any(t is c.out for c in self.calls) for t in leaves]
        return PiecewiseGraph(
            name=self.name,
            output=rebuild(leaves),
            input_ptrs=input_ptrs,
            memory_bytes=peak + sum(persistent.values()),
            graph_pool=self.backend.pool,
            uncompiled=tuple(dict.fromkeys(f for names in self._uncompiled for f in names)),
            pieces=pieces,
            calls=self.calls,
            leaves=leaves,
            owned=owned,
        )

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.end_piece()
        for records in self.records:
            records.clear()


class _TapePiece:
    def __init__(self, tape: Any, exports: list[torch.Tensor]) -> None:
        self.tape, self.exports = tape, exports

    def replay(self) -> None:
        with torch.inference_mode(), no_torch_function():  # no engine's torch mode sees a graph's ops
            for tensor, value in zip(self.exports, self.tape.run()):
                if value is not None:
                    tensor.copy_(value)

    def release(self) -> None:
        self.tape, self.exports = None, []


def _check_result(op: Any, result: Any, like: torch.Tensor | None = None) -> None:
    if not isinstance(result, torch.Tensor):
        raise CaptureError(
            f"{op!r} returned {type(result).__name__}; an eager_op returns one tensor (its result lands in a "
            "static tensor the next piece reads)"
        )
    if like is not None and (result.shape != like.shape or result.dtype != like.dtype):
        raise CaptureError(
            f"{op!r} returned {tuple(result.shape)} {result.dtype} where capture saw {tuple(like.shape)} "
            f"{like.dtype}: an eager_op's result shape may depend only on its tensor arguments, not on the "
            "step's metadata"
        )


def _made(records: list) -> dict[int, torch.Tensor]:
    """Tensors an op of `records` produced, by id (the records keep them alive)."""
    made: dict[int, torch.Tensor] = {}
    for _, _, _, out in records:
        for t in _tensors(out):
            made.setdefault(id(t), t)
    return made


def _tensors(value: Any):
    """Every tensor in a (nested) tuple, list or dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def request_views(inputs: Any) -> dict[str, Any]:
    """The request-dim views of a step (`[R+1]`, `[R]`, `[R, B]` and the engine's `reqs` and `reqs+1` buffers).

    Their shape follows the step's request count, which a piecewise key does not fix: no piece
    may read them. Eager ops read them through `current_inputs()`.
    """
    views = {name: getattr(inputs, name) for name in REQUEST_FIELDS}
    per_request = [s.name for s in inputs.limits.extras if s.rows in ("reqs", "reqs+1")]
    views.update({f"extras[{name!r}]": inputs.extras[name] for name in per_request})
    return views


class _ForbiddenReads(TorchDispatchMode):
    def __init__(self, views: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.views = {id(t): name for name, t in views.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in _tensors((args, kwargs)):
            name = self.views.get(id(value))
            if name is not None:
                raise CaptureError(
                    f"the forward reads inputs.{name} ({func}) at {_user_location()} outside any eager_op: in "
                    "a piecewise graph the code between eager ops is captured for a token count alone, and "
                    "request metadata changes shape from step to step. Read it inside a function marked "
                    "graphcap.eager_op, through graphcap.current_inputs()"
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbidden_reads(inputs: Any) -> Iterator[None]:
    """Refuse (`CaptureError` naming the field, op and line) any op outside an eager op that reads
    the step's request metadata (`request_views`). Eager ops run with it popped.

    The check is a dispatch mode, so it runs only inside the preflight (the checked first warmup,
    where torch.compile is off): elsewhere it does nothing. A compiled function whose first call
    meets a dispatch mode never compiles (a `fullgraph=True` one raises on every later call), so
    the plain warmups of a piecewise key, which must compile it before capture, run with no mode.
    """
    if not in_preflight():
        yield
        return
    with _ForbiddenReads(request_views(inputs)):
        yield
