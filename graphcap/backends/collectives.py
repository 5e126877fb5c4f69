"""Functional collectives on the emulated backend's tape.

The functional collectives (`torch.ops._c10d_functional.all_reduce`, `all_gather_into_tensor`,
`reduce_scatter_tensor`, ..., then `wait_tensor`) are dispatcher ops that return a new
tensor: the tape records them like any op, and a replay runs each collective again, with the
peers replaying the same graph (every rank must replay together, as on CUDA). funcol's Python
API (`torch.distributed._functional_collectives.all_reduce`, ...) wraps the result in an
`AsyncCollectiveTensor` that waits on first use; an op given one gets the tensor inside it,
after a `wait_tensor` recorded at that first use. The in-place forms (`dist.all_reduce(t)`,
`c10d.allreduce_`, returning a `Work`) are refused by the unsafe-op table's collective rows,
which name the functional form to write instead.

`observed` gives the tape a collective's call that first tells the observer `observing` set in
this context (`graphcap.distributed.ledger` publishes the collectives of verification's replays
with it); without one, the call costs one context-variable read more.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

__all__ = ["is_async", "observed", "observing", "unwrap_async"]

_OBSERVER: ContextVar[Callable[[Any, tuple, dict], None] | None] = ContextVar("graphcap_collectives", default=None)


@contextlib.contextmanager
def observing(observer: Callable[[Any, tuple, dict], None]) -> Iterator[None]:
    """Within it (this context only), each functional collective a tape replays calls `observer(op, args, kwargs)`
    before it is issued."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def observed(func: Any, call: Callable) -> Callable:
    """`call` (the tape's call of `func`), telling the current observer first when `func` is a functional
    collective (not `wait_tensor`); any other op's `call` as it is. Named as `func` (`_name`), as the tape's
    readers name steps."""
    name = func.name() if callable(getattr(func, "name", None)) else ""
    if not name.startswith("_c10d_functional::") or name.endswith("wait_tensor"):
        return call

    def run(*args: Any, **kwargs: Any) -> Any:
        observer = _OBSERVER.get()
        if observer is not None:
            observer(func, args, kwargs)
        return call(*args, **kwargs)

    run._name = name  # type: ignore[attr-defined]
    return run


def is_async(value: Any) -> bool:
    """Whether `value` is funcol's AsyncCollectiveTensor (the wrap is not recorded: ops get its tensor)."""
    kind = _async_collective_tensor()
    return kind is not None and isinstance(value, kind)


def unwrap_async(records: list, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args`, `kwargs` with each AsyncCollectiveTensor replaced by its tensor; its first use appends
    `(wait_tensor, (tensor,), {}, tensor)` to `records` (the tape then waits where eager code did)."""
    kind = _async_collective_tensor()
    if kind is None or not (_holds(kind, args) or (kwargs and _holds(kind, kwargs.values()))):
        return args, kwargs

    def waited(value: Any) -> Any:
        if isinstance(value, kind):
            if not value.completed:
                value.trigger_wait()  # inside a dispatch mode's handler: no mode records it by itself
                records.append((torch.ops._c10d_functional.wait_tensor.default, (value.elem,), {}, value.elem))
            return value.elem
        if isinstance(value, (list, tuple)):
            return type(value)(waited(item) for item in value)
        return value

    return waited(args), {key: waited(value) for key, value in kwargs.items()}


@functools.cache
def _async_collective_tensor() -> type[AsyncCollectiveTensor] | None:
    """funcol's AsyncCollectiveTensor, or None when torch.distributed is not built in."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:
        return None
    return AsyncCollectiveTensor


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None), torch.dtype, torch.device})
"""Types no AsyncCollectiveTensor is or holds: what almost every argument of a recorded op is."""


def _holds(kind: type, values: Any) -> bool:
    """Whether any of `values` (a sequence, or a dict's values), or anything in a list, tuple or dict among
    them at any depth, is a `kind`. Every recorded op asks, so plain types are passed over first."""
    for value in values:
        if type(value) in _PLAIN:
            continue
        if isinstance(value, kind):
            return True
        if isinstance(value, (list, tuple)):
            if _holds(kind, value):
                return True
        elif isinstance(value, dict) and _holds(kind, value.values()):
            return True
    return False
