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
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["is_async", "unwrap_async"]


def is_async(value: Any) -> bool:
    """Whether `value` is funcol's AsyncCollectiveTensor (the wrap is not recorded: ops get its tensor)."""
    kind = _async_collective_tensor()
    return kind is not None and isinstance(value, kind)


def unwrap_async(records: list, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args`, `kwargs` with each AsyncCollectiveTensor replaced by its tensor; its first use appends
    `(wait_tensor, (tensor,), {}, tensor)` to `records` (the tape then waits where eager code did)."""
    kind = _async_collective_tensor()
    if kind is None or not _holds(kind, (args, kwargs)):
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
def _async_collective_tensor() -> type | None:
    """funcol's AsyncCollectiveTensor, or None when torch.distributed is not built in."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:
        return None
    return AsyncCollectiveTensor


def _holds(kind: type, values: Any) -> bool:
    if isinstance(values, kind):
        return True
    if isinstance(values, dict):
        values = values.values()
    elif not isinstance(values, (list, tuple)):
        return False
    for value in values:  # a loop, not any(generator): every recorded op asks
        if isinstance(value, kind) or (not isinstance(value, torch.Tensor) and _holds(kind, value)):
            return True
    return False
