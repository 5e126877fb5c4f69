"""Ops a CUDA graph cannot hold, as one table, and the checker that names them.

A CUDA graph replays device work only. An op whose result the host must read (a value,
or an output shape that depends on values) makes the host wait for the GPU, which
capture cannot hold (CUDA error 900 at best, a frozen stale value at worst). Both
backends run the forward under `unsafe_op_checker`: the emulated backend during capture
(and the first warmup), the CUDA backend during the first warmup (its preflight) and
capture. It raises `CaptureUnsafeError` naming the op, the reason and the innermost
stack frame outside torch and outside graphcap/backends, i.e. the user's line.

An op counts only when one of its tensors lives on the graph's device (on the emulated
backend, the CPU). Host code in a forward is not an error here, but a graph freezes what it
computes: CUDA runs the host side once, at capture. A per-step value computed on the host
(from `inputs.host`, `inputs.num_tokens`, `.item()`) belongs in `prepare()`, written into a
persistent buffer (an engine `BufferSpec`) that the forward reads as a tensor; capture-time
verification replays a partly filled second batch to catch a value frozen by mistake.

| op | when | why |
|---|---|---|
| aten._local_scalar_dense, aten.item, aten.is_nonzero | always | reads a value on the host |
| aten.equal | always | returns a Python bool (a host read) |
| aten.nonzero, aten.nonzero_numpy, aten.argwhere | always | output shape from values |
| aten.where | one-argument overload | same as nonzero |
| aten.masked_select | always | output shape from values |
| aten._unique, _unique2, unique_dim, unique_consecutive, unique_dim_consecutive | always | same |
| aten.index, index_put, index_put_, _index_put_impl_ | bool/uint8 index | a mask is a nonzero |
| aten.repeat_interleave | Tensor overloads without output_size | output length is a sum |
| aten.bincount | always | output length is max(input) + 1 (even with minlength) |
| Tensor.item, __int__, __float__, __bool__, __index__ | device tensor | reads a value on the host |
| Tensor.tolist, numpy, __array__, cpu | device tensor | copies to host memory |
| Tensor.to | device tensor to "cpu" (a string, or a CPU device not the graph's) | same |

The `Tensor.*` rows are caught by Python method (a `TorchFunctionMode`) because torch
does not show them as distinct aten ops; the aten rows catch the same reads reached
from C++ (slicing with a tensor bound, composite ops). Add an op here and to the
parametrized test in tests/backends/test_unsafe.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphcap.errors import CaptureUnsafeError

__all__ = ["UNSAFE_OPS", "UnsafeOp", "UnsafeOpMode", "check_op", "unsafe_op_checker"]

_Applies = Callable[[Any, tuple, dict, torch.device], bool]


@dataclass(frozen=True, slots=True)
class UnsafeOp:
    """One row of the table: an op and why a CUDA graph cannot hold it."""

    name: str
    """aten overload packet ("aten.nonzero") or Python method ("Tensor.item")."""
    reason: str
    """Why capture cannot hold it; completes "<op> at <file:line>: ..."."""
    fix: str
    """What to write instead."""
    applies: _Applies | None = None
    """(overload or method, args, kwargs, graph device) -> bool; None: every call is unsafe."""


_SYNC = "so the host must wait for the GPU; a CUDA graph cannot hold a host sync"
_READ = f"it reads a tensor value into Python, {_SYNC}, and the value would be frozen at capture"
_SHAPE = f"the output shape depends on tensor values, {_SYNC}"
_COPY = f"it copies device data to host memory, {_SYNC}, and replays would not refresh the copy"
_FIX_READ = (
    "Keep the value on the device (torch.where, tensor arithmetic); a per-step value computed on the "
    "host belongs in prepare(), written into a persistent buffer (a BufferSpec) that the forward reads "
    "as a tensor, never read into Python inside the forward (a graph would freeze it)"
)
_FIXED_SIZE_FORMS = "torch.where(mask, x, fill), nonzero_static, or pass output_size="
_FIX_SHAPE = f"Use a fixed-size formulation ({_FIXED_SIZE_FORMS})"
_FIX_UNIQUE = "Use a fixed-size formulation (sort, then mask duplicates with torch.where)"
_FIX_MASK = "Use torch.where(mask, x, fill) or multiply by the mask; index with integer indices"
_FIX_COPY = "Keep the data on the device inside the forward; copy results after replay"


def _has_mask_index(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    # index.Tensor(self, Tensor?[] indices) and the index_put variants share args[1].
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    masks = (torch.bool, torch.uint8)
    return any(isinstance(i, torch.Tensor) and i.dtype in masks for i in indices or ())


def _no_output_size(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    # self_int repeats a fixed count: its output shape is known on the host.
    return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None


def _is_one_arg_where(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    return func._overloadname == "default"  # where(condition); where.self etc. are fine


def _is_host_target(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """Whether Tensor.to(*args, **kwargs) moves to the host (see the table's last row)."""
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, str) and torch.device(target).type == "cpu":
            return True  # written as a literal: the forward asks for host memory
        if isinstance(target, torch.device) and target.type == "cpu" and target != device:
            return True
    return False


def _rows() -> Iterator[UnsafeOp]:
    for name in ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero"):
        yield UnsafeOp(name, _READ, _FIX_READ)
    yield UnsafeOp(
        "aten.equal",
        f"it returns a Python bool, {_SYNC}",
        "Compare on the device: (a == b).all() stays a tensor",
    )
    for name in ("aten.nonzero", "aten.nonzero_numpy", "aten.argwhere", "aten.masked_select"):
        yield UnsafeOp(name, _SHAPE, _FIX_SHAPE)
    yield UnsafeOp("aten.where", _SHAPE, _FIX_SHAPE, _is_one_arg_where)
    for name in ("_unique", "_unique2", "unique_dim", "unique_consecutive"):
        yield UnsafeOp(f"aten.{name}", _SHAPE, _FIX_UNIQUE)
    yield UnsafeOp("aten.unique_dim_consecutive", _SHAPE, _FIX_UNIQUE)
    for name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        yield UnsafeOp(
            f"aten.{name}",
            f"a boolean mask index is a nonzero: {_SHAPE}",
            _FIX_MASK,
            _has_mask_index,
        )
    yield UnsafeOp(
        "aten.repeat_interleave",
        f"without output_size the output length is the sum of repeats: {_SHAPE}",
        "Pass output_size= (the padded total length)",
        _no_output_size,
    )
    yield UnsafeOp(
        "aten.bincount",
        f"the output length is max(input) + 1, even with minlength: {_SHAPE}",
        "Use torch.zeros(n).scatter_add_(0, x, ones) with a fixed n",
    )
    for method in ("item", "__int__", "__float__", "__bool__", "__index__"):
        yield UnsafeOp(f"Tensor.{method}", _READ, _FIX_READ)
    for method in ("tolist", "numpy", "__array__", "cpu"):
        yield UnsafeOp(f"Tensor.{method}", _COPY, _FIX_COPY)
    yield UnsafeOp("Tensor.to", _COPY, _FIX_COPY, _is_host_target)


UNSAFE_OPS: Mapping[str, UnsafeOp] = MappingProxyType({row.name: row for row in _rows()})
"""The table: op name -> row. Read-only; extend `_rows` (and the test) instead."""

# Python methods looked up by the function object torch hands to __torch_function__.
_METHODS: dict[Any, UnsafeOp] = {
    getattr(torch.Tensor, name.removeprefix("Tensor.")): row
    for name, row in UNSAFE_OPS.items()
    if name.startswith("Tensor.")
}
_SKIP_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)


def _user_location() -> str:
    """file:line of the innermost frame outside torch/ and graphcap/backends/."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown location>"
    path = os.path.abspath(frame.f_code.co_filename)
    cwd = os.getcwd() + os.sep
    shown = os.path.relpath(path) if path.startswith(cwd) else path
    return f"{shown}:{frame.f_lineno}"


def _raise(row: UnsafeOp, shown_name: str) -> None:
    raise CaptureUnsafeError(shown_name, _user_location(), row.reason, row.fix)


@functools.cache
def _row_for(func: Any) -> UnsafeOp | None:
    return UNSAFE_OPS.get(str(func._overloadpacket))


def _touches_device(args: tuple, kwargs: dict, device_type: str) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, torch.Tensor) and v.device.type == device_type for v in value):
                return True
        elif isinstance(value, torch.Tensor) and value.device.type == device_type:
            return True
    return False


def check_op(func: Any, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Raise `CaptureUnsafeError` if the aten overload `func` is unsafe on `device`."""
    row = _row_for(func)
    if row is None or not _touches_device(args, kwargs, device.type):
        return
    if row.applies is None or row.applies(func, args, kwargs, device):
        overload = func._overloadname
        _raise(row, row.name if overload == "default" else f"{row.name}.{overload}")


class _HostReadMode(TorchFunctionMode):
    """Catches host reads and copies by Python method (invisible as distinct aten ops)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        row = _METHODS.get(func)
        if (
            row is not None
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type == self._device.type
            and (row.applies is None or row.applies(func, args, kwargs, self._device))
        ):
            _raise(row, row.name)
        return func(*args, **kwargs)


class UnsafeOpMode(TorchDispatchMode):
    """Checks every aten op against the table, then runs it via `run_op` (a recorder hook)."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_op(func, args, kwargs, self.device)
        return self.run_op(func, args, kwargs)

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


@contextlib.contextmanager
def unsafe_op_checker(
    device: torch.device | str,
    mode: UnsafeOpMode | None = None,
) -> Iterator[None]:
    """Run the enclosed forward under the checker; `mode` may be a recording subclass."""
    device = torch.device(device)
    with _HostReadMode(device), mode if mode is not None else UnsafeOpMode(device):
        yield
