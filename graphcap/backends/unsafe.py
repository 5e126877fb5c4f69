"""Ops a CUDA graph cannot hold, as one table.

A CUDA graph replays device work only. An op whose result the host must read (a value,
or an output shape that depends on values), a copy through pageable host memory, or a
wait for the GPU makes the host synchronize with it, which stream capture cannot hold
(CUDA error 900, the capture invalidated, at best; a value frozen at capture at worst).
The checker in `graphcap.backends.preflight` runs a forward against this table and raises
`CaptureUnsafeError` naming the op, the reason and the user's file:line.

An op counts only when one of its tensors (or its target device) is on the graph's
device type. Rows marked "CUDA" can only fire for a graph device other than the CPU, since
they are about crossing between host and device memory: the emulated backend (whose device
is the CPU) cannot see them; `check_capture_safe(fn, "cuda")` under `FakeTensorMode` can, on
any machine. Host code in a forward is not an error here, but a graph freezes what it
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
| aten.index | bool/uint8 index | a mask is a nonzero |
| aten.index_put, index_put_, _index_put_impl_ | bool/uint8 index, unless it becomes a masked_fill_ | same |
| aten.repeat_interleave | Tensor overloads without output_size | output length is a sum |
| aten.bincount | always | output length is max(input) + 1 (even with minlength) |
| aten._to_copy, aten.copy_ | CUDA: host <-> device, unless non_blocking from/to pinned memory | a pageable copy waits |
| aten.masked_fill(_), aten.index_fill(_) | CUDA: the fill value is a device tensor | the kernel reads it with .item() |
| Tensor.item, __int__, __float__, __bool__, __index__ | device tensor | reads a value on the host |
| Tensor.tolist, numpy, __array__, cpu | device tensor | copies to host memory |
| Tensor.to | device tensor to "cpu" (a string, or a CPU device not the graph's) | same |
| Tensor.__repr__, __format__ (`print(t)`, `str(t)`, f-strings, log messages) | device tensor | same, to format it |
| torch.tensor, torch.as_tensor, torch.asarray | CUDA: host data to the device | a pageable copy, below the dispatcher |
| torch.cuda.synchronize, empty_cache; Stream/Event .synchronize, .query | always | waits for (or asks) the GPU |
| c10d.allreduce_, (_)allgather(_base)_, (_)reduce_scatter(_base)_, broadcast_, alltoall_base_ | emulated | a Work |

`x[mask] = scalar` is capturable: with one mask index and a one-element host value,
`index_put_` runs `masked_fill_` (no sync), so that case is not in the table.
The `Tensor.*` and `torch.tensor`-like rows are caught by Python function (a
`TorchFunctionMode`), because torch does not show them as distinct aten ops, or shows
them below the Python dispatch key; the `torch.cuda.*` rows are not tensor ops at all.
The collective rows are the emulated backend's, not CUDA's (a CUDA graph holds an in-place
NCCL collective): `dist.all_reduce(t)` and kin return a Work (an async handle) that the
emulated tape cannot replay, while the functional collectives return tensors and record
(`graphcap.backends.collectives`); the fix names the functional form.
Add a row here and a trigger to the test in tests/backends/test_unsafe.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["PYTHON_UPLOADS", "SYNC_FUNCTIONS", "UNSAFE_OPS", "UnsafeOp", "python_upload_row"]

_Applies = Callable[[Any, tuple, dict, torch.device], bool]


@dataclass(frozen=True, slots=True)
class UnsafeOp:
    """One row of the table: an op and why a CUDA graph cannot hold it."""

    name: str
    """aten overload packet ("aten.nonzero"), Python method ("Tensor.item") or function ("torch.tensor")."""
    reason: str
    """Why capture cannot hold it; completes "<op> at <file:line>: ..."."""
    fix: str
    """What to write instead."""
    applies: _Applies | None = None
    """(overload or function, args, kwargs, graph device) -> bool; None: every call is unsafe."""


_SYNC = "so the host must wait for the GPU; a CUDA graph cannot hold a host sync"
_READ = f"it reads a tensor value into Python, {_SYNC}, and the value would be frozen at capture"
_SHAPE = f"the output shape depends on tensor values, {_SYNC}"
_COPY = f"it copies device data to host memory, {_SYNC}, and replays would not refresh the copy"
_PAGEABLE = (
    f"it copies between host and device memory through a pageable (or blocking) transfer, {_SYNC}, "
    "and the host data would be frozen at capture"
)
_WAIT = f"it waits for (or asks about) work on the GPU, {_SYNC}"
_PRINT = (
    f"it formats the tensor's values as text (print, str, an f-string, a log message): it copies device data "
    f"to host memory, {_SYNC}, and the text would show the capture run's values only (a replay runs no Python)"
)
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
_FIX_UPLOAD = (
    "Create device tensors before capture (a persistent buffer, register it) and fill them in place "
    "outside the forward, or copy with non_blocking=True from pinned memory"
)
_FIX_WAIT = "Remove it from the forward: a graph's kernels are ordered on its stream already"
_FIX_PRINT = (
    "Remove it from the forward: print what execute() returns after it returns, or debug the step "
    "eagerly with manager.eager(batch); format shapes and dtypes (t.shape), never values"
)
_FIX_FILL = "Pass the fill value as a Python number, or use torch.where(mask, value_tensor, x)"
_COLLECTIVE = (
    "an in-place collective returns a Work (an async handle) that the emulated backend's tape cannot replay "
    "(a CUDA graph holds it; the emulated backend records functional collectives, which return tensors)"
)
_FUNCTIONAL = {  # in-place c10d op -> its functional form (torch.distributed._functional_collectives)
    "allreduce_": "all_reduce",
    "allgather_": "all_gather_tensor",
    "_allgather_base_": "all_gather_tensor",
    "reduce_scatter_": "reduce_scatter_tensor",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all_single",
}


def _has_mask_index(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    # index.Tensor(self, Tensor?[] indices) and the index_put variants share args[1].
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    masks = (torch.bool, torch.uint8)
    return any(isinstance(i, torch.Tensor) and i.dtype in masks for i in indices or ())


def _is_mask_put(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """A masked index_put that does not become masked_fill_ (ATen's canDispatchToMaskedFill)."""
    if not _has_mask_index(func, args, kwargs, device):
        return False
    self = args[0]
    indices = [i for i in (args[1] if len(args) > 1 else kwargs.get("indices", ())) if i is not None]
    values = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    becomes_masked_fill = (
        not accumulate
        and isinstance(values, torch.Tensor)
        and values.numel() == 1
        and values.device.type == "cpu"
        and len(indices) == 1
        and indices[0].device == self.device
    )
    return not becomes_masked_fill


def _no_output_size(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    # self_int repeats a fixed count: its output shape is known on the host.
    return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None


def _is_one_arg_where(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    return func._overloadname == "default"  # where(condition); where.self etc. are fine


def _is_host_target(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """Whether Tensor.to(*args, **kwargs) moves to the host (see the table)."""
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, str) and torch.device(target).type == "cpu":
            return True  # written as a literal: the forward asks for host memory
        if isinstance(target, torch.device) and target.type == "cpu" and target != device:
            return True
    return False


def _is_pinned(host: torch.Tensor) -> bool:
    """Whether a host tensor is in pinned memory; a build without CUDA pins nothing (and may raise)."""
    try:
        return bool(host.is_pinned())
    except RuntimeError:
        return False


def _crosses(source: Any, target_type: str, device: torch.device, non_blocking: bool) -> bool:
    """A copy between host memory and the (non-CPU) graph device that capture cannot hold."""
    if device.type == "cpu" or not isinstance(source, torch.Tensor):
        return False
    source_type = source.device.type
    if {source_type, target_type} != {"cpu", device.type}:
        return False
    host_is_pinned = source_type != "cpu" or _is_pinned(source)
    # Device -> host always lands in fresh pageable memory (_to_copy allocates it).
    return not (non_blocking and host_is_pinned and source_type == "cpu")


def _is_blocking_to_copy(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    target = kwargs.get("device")
    if not isinstance(target, torch.device):
        return False
    return _crosses(args[0], target.type, device, bool(kwargs.get("non_blocking", False)))


def _is_blocking_copy(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if device.type == "cpu" or not isinstance(src, torch.Tensor):
        return False
    types = {dst.device.type, src.device.type}
    if types != {"cpu", device.type}:
        return False
    host = dst if dst.device.type == "cpu" else src
    return not (non_blocking and _is_pinned(host))


def _fill_value_on_device(position: int) -> _Applies:
    def applies(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
        value = args[position] if len(args) > position else kwargs.get("value", kwargs.get("source"))
        return device.type != "cpu" and isinstance(value, torch.Tensor) and value.device.type == device.type

    return applies


def _uploads_host_data(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """torch.tensor / as_tensor / asarray of host data (not a device tensor) onto the graph device."""
    target = kwargs.get("device", args[2] if func is torch.as_tensor and len(args) > 2 else None)
    if target is None or device.type == "cpu":
        return False
    if torch.device(target).type != device.type:
        return False
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    return not (isinstance(data, torch.Tensor) and data.device.type == device.type)


def _on_host_graph(func: Any, args: tuple, kwargs: dict, device: torch.device) -> bool:
    return device.type == "cpu"  # the emulated backend's graphs; a CUDA graph holds in-place NCCL collectives


def _rows() -> Iterator[UnsafeOp]:
    for name in ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero"):
        yield UnsafeOp(name, _READ, _FIX_READ)
    yield UnsafeOp(
        "aten.equal", f"it returns a Python bool, {_SYNC}", "Compare on the device: (a == b).all() stays a tensor"
    )
    for name in ("aten.nonzero", "aten.nonzero_numpy", "aten.argwhere", "aten.masked_select"):
        yield UnsafeOp(name, _SHAPE, _FIX_SHAPE)
    yield UnsafeOp("aten.where", _SHAPE, _FIX_SHAPE, _is_one_arg_where)
    for name in ("_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"):
        yield UnsafeOp(f"aten.{name}", _SHAPE, _FIX_UNIQUE)
    mask = f"a boolean mask index is a nonzero: {_SHAPE}"
    yield UnsafeOp("aten.index", mask, _FIX_MASK, _has_mask_index)
    for name in ("index_put", "index_put_", "_index_put_impl_"):
        yield UnsafeOp(f"aten.{name}", mask, f"{_FIX_MASK} (x[mask] = scalar is fine)", _is_mask_put)
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
    yield UnsafeOp("aten._to_copy", _PAGEABLE, _FIX_UPLOAD, _is_blocking_to_copy)
    yield UnsafeOp("aten.copy_", _PAGEABLE, _FIX_UPLOAD, _is_blocking_copy)
    fill = f"the CUDA kernel reads a device fill value with .item(), {_SYNC}"
    for name in ("masked_fill", "masked_fill_"):
        yield UnsafeOp(f"aten.{name}", fill, _FIX_FILL, _fill_value_on_device(2))
    for name in ("index_fill", "index_fill_"):
        yield UnsafeOp(f"aten.{name}", fill, _FIX_FILL, _fill_value_on_device(3))
    for method in ("item", "__int__", "__float__", "__bool__", "__index__"):
        yield UnsafeOp(f"Tensor.{method}", _READ, _FIX_READ)
    for method in ("tolist", "numpy", "__array__", "cpu"):
        yield UnsafeOp(f"Tensor.{method}", _COPY, _FIX_COPY)
    yield UnsafeOp("Tensor.to", _COPY, _FIX_COPY, _is_host_target)
    for method in ("__repr__", "__format__"):
        yield UnsafeOp(f"Tensor.{method}", _PRINT, _FIX_PRINT)
    for function in ("tensor", "as_tensor", "asarray"):
        yield UnsafeOp(f"torch.{function}", _PAGEABLE, _FIX_UPLOAD, _uploads_host_data)
    for name in SYNC_FUNCTIONS:
        yield UnsafeOp(name, _WAIT, _FIX_WAIT)
    for name, functional in _FUNCTIONAL.items():
        fix = (
            f"Use torch.distributed._functional_collectives.{functional} (or the torch.ops._c10d_functional op "
            "and wait_tensor): it returns a new tensor, which the tape records and every replay recomputes"
        )
        yield UnsafeOp(f"c10d.{name}", _COLLECTIVE, fix, _on_host_graph)


SYNC_FUNCTIONS = (
    "torch.cuda.synchronize",
    "torch.cuda.empty_cache",
    "torch.cuda.Stream.synchronize",
    "torch.cuda.Stream.query",
    "torch.cuda.Event.synchronize",
    "torch.cuda.Event.query",
)
"""Python-level waits for the GPU: no tensor op shows them, so the checker wraps them."""

UNSAFE_OPS: Mapping[str, UnsafeOp] = MappingProxyType({row.name: row for row in _rows()})
"""The table: op name -> row. Read-only; extend `_rows` (and the test) instead."""


def _to_target(args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """(target device or None, non_blocking) of a `Tensor.to` call, parsed as torch parses it."""
    try:
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return None, False
    return device, bool(non_blocking)


def _cuda_target(args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """(target device, non_blocking) of a `Tensor.cuda(device=None, non_blocking=False)` call."""
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return torch.device("cuda"), bool(non_blocking)


def python_upload_row(func: Any, args: tuple, kwargs: dict, device: torch.device) -> UnsafeOp | None:
    """The row of a Python-level copy between host and device memory, classified by its arguments.

    `Tensor.copy_`, `Tensor.to` and `Tensor.cuda` enter the device (a device guard, a current-device
    lookup) before the dispatcher sees them: on a CPU-only build under `FakeTensorMode` they raise
    inside torch. Classified here, before they run, as the aten op each becomes, they are named the
    same way on every build.
    """
    if func is torch.Tensor.copy_:
        row = UNSAFE_OPS["aten.copy_"]
        applies = row.applies
        return row if len(args) > 1 and applies is not None and applies(func, args, kwargs, device) else None
    target, non_blocking = _TARGETS[func](args, kwargs)
    source = args[0] if args else None
    if not isinstance(target, torch.device) or not isinstance(source, torch.Tensor) or source.device.type != "cpu":
        return None  # a device tensor to the host is the `Tensor.to` / `Tensor.cpu` row's
    row = UNSAFE_OPS["aten._to_copy"]
    to_copy = {"device": target, "non_blocking": non_blocking}
    applies = row.applies
    return row if applies is not None and applies(func, (args[0],), to_copy, device) else None


_TARGETS = {torch.Tensor.to: _to_target, torch.Tensor.cuda: _cuda_target}
PYTHON_UPLOADS = (torch.Tensor.copy_, *_TARGETS)
"""Python methods that copy host data to the device, classified by `python_upload_row` before they run."""
