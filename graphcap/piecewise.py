"""`eager_op` and `current_inputs`: the two names a model uses to run parts of itself eagerly.

Piecewise capture (modes `piecewise` and `full_and_piecewise`) cuts a forward at every call of
a function decorated with `eager_op`: the code between two such calls is captured as one graph
(a piece), the decorated function runs eagerly between the pieces on every replay, on the real
batch. It is how attention that cannot be captured for every batch shape (host-planned splits,
`.item()` lengths, data-dependent kernels) coexists with graphs for everything else.

The contract of an `eager_op` function:

- Tensor arguments are static: parameters, persistent buffers, or tensors an earlier piece
  made (a replay rewrites them in place). Non-tensor arguments are frozen at capture.
- Per-step metadata varies in shape from step to step, so an eager op never takes it from its
  captured arguments: it reads the step being run through `current_inputs()` (the
  `ForwardInputs` of the current step), which works the same in eager runs, capture and replay.
- The result is one tensor whose shape depends only on its tensor arguments. It lands in a
  static tensor: a function with an `out=None` parameter writes into it in place on replay
  (and returns it, or None); otherwise the result is copied into it (one copy per call,
  counted in `CaptureManager.stats`). The capture calls it without `out` to learn the shape.
- Inside the function anything goes, capture-unsafe ops included: it never runs in a graph,
  except that a *full* graph (mode `full`, or the uniform keys of `full_and_piecewise`)
  captures the whole forward. For those, pass `capturable=`: a graph-safe implementation with
  the same signature that full graphs use instead (without it the function itself is
  captured and must be graph-safe; a capture-unsafe body is refused naming the op, and
  `capture.mode: piecewise` runs it eagerly for every key).
- During a piecewise capture on CUDA the pieces are only recorded, not run: the function is
  called once with tensors no kernel has written yet (uninitialised pool memory). It must not
  use values of its tensor arguments for indexing or sizes then (an out-of-range index is a
  device-side assert, which poisons the CUDA context for good); values read through
  `current_inputs()` are the real, staged ones.
- A result read after the graph was released or captured again reads freed device memory on
  CUDA (an illegal address, also sticky): read results before the next `capture()`/`release()`.

Outside any graphcap step an `eager_op` is a plain call of the function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, overload

from graphcap.errors import CaptureError, CaptureUnsafeError
from graphcap.phases import recording

if TYPE_CHECKING:
    from graphcap.inputs import ForwardInputs

__all__ = ["current_inputs", "eager_op"]

Phase = Literal["eager", "full", "piecewise", "piecewise_warmup"]
"""What the running forward feeds: an eager run, a full graph (capture or warmup of it), a
piecewise capture (the session then cuts the forward at each eager op), or a warmup of a
piecewise key (its session runs eager ops outside the unsafe-op checker: their bodies never run in
a graph)."""

_INPUTS: ContextVar[ForwardInputs | None] = ContextVar("graphcap_current_inputs", default=None)
_PHASE: ContextVar[tuple[Phase, Any]] = ContextVar("graphcap_phase", default=("eager", None))


def current_inputs() -> ForwardInputs:
    """The `ForwardInputs` of the step being run (an eager run, a capture, or a replay).

    Raises `CaptureError` outside a step: an eager op must be called from a forward that
    `CaptureManager` runs (or inside `running(inputs)`).
    """
    inputs = _INPUTS.get()
    if inputs is None:
        raise CaptureError(
            "current_inputs() was called outside a step; call it from an eager_op (or a forward) that "
            "CaptureManager runs, or wrap a direct call in graphcap.piecewise.running(inputs)"
        )
    return inputs


@contextlib.contextmanager
def running(inputs: ForwardInputs, phase: Phase = "eager", session: Any = None) -> Iterator[None]:
    """Make `inputs` the current step (and say what the forward feeds) for the enclosed code."""
    token = _INPUTS.set(inputs)
    phase_token = _PHASE.set((phase, session))
    try:
        yield
    finally:
        _PHASE.reset(phase_token)
        _INPUTS.reset(token)


class EagerOp:
    """A function marked to run eagerly between the pieces of a piecewise graph (see the module doc)."""

    def __init__(self, fn: Callable[..., Any], capturable: Callable[..., Any] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"eager_op decorates a function; got {type(fn).__name__}")
        if capturable is not None and not callable(capturable):
            raise TypeError(f"eager_op(capturable=...) must be a function; got {type(capturable).__name__}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.capturable = capturable
        out = inspect.signature(fn).parameters.get("out")
        self.takes_out = out is not None
        """Whether `fn(..., out=tensor)` writes its result in place (no copy on replay)."""
        if out is not None and out.default is not None:
            raise TypeError(
                f"eager_op {getattr(fn, '__qualname__', fn)}: its out parameter must default to None (the "
                "capture calls it without out= to learn the result's shape; replays then pass the static result)"
            )

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # Decorating a method: bind like a function would, keeping the EagerOp behaviour.
        return self if instance is None else functools.partial(self.__call__, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        phase, session = _PHASE.get()
        if phase == "piecewise":  # the op runs eagerly between two pieces: no graph records it
            with recording(False):
                return session.cut(self, args, kwargs)
        if phase == "full":
            if self.capturable is not None:
                return self.capturable(*args, **kwargs)
            return self._in_full_graph(args, kwargs)
        if phase == "piecewise_warmup":  # the pass's session runs the body outside its checks
            return session.run_eager(self.fn, args, kwargs)
        return self.fn(*args, **kwargs)

    def _in_full_graph(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the function itself inside a full graph; a capture-unsafe body is refused naming this op."""
        try:
            return self.fn(*args, **kwargs)
        except CaptureUnsafeError as exc:
            raise CaptureUnsafeError(
                exc.op,
                exc.location,
                f"{exc.reason}; it runs inside {self!r}, which a full graph (mode full or full_decode_only, or "
                "the uniform keys of full_and_piecewise) captures whole because it has no capturable= twin",
                f"Pass a graph-safe implementation with the same signature as eager_op(capturable=...), or use "
                f"capture.mode: piecewise, which runs {self!r} eagerly between graph pieces for every key",
            ) from exc

    def __repr__(self) -> str:
        return f"eager_op({getattr(self.fn, '__qualname__', self.fn)})"


@overload
def eager_op(fn: Callable[..., Any], *, capturable: Callable[..., Any] | None = None) -> EagerOp: ...
@overload
def eager_op(
    fn: None = None, *, capturable: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], EagerOp]: ...
def eager_op(
    fn: Callable[..., Any] | None = None, *, capturable: Callable[..., Any] | None = None
) -> EagerOp | Callable[[Callable[..., Any]], EagerOp]:
    """Mark `fn` to run eagerly between graph pieces; `@eager_op` or `@eager_op(capturable=...)`."""
    if fn is None:
        return lambda f: EagerOp(f, capturable)
    return EagerOp(fn, capturable)
