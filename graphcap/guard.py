"""`StaticGuard`: the tensors a graph reads in place, recorded at capture and checked before every replay.

A CUDA graph holds raw addresses. A static tensor that moves after capture (a parameter
replaced by a new one, `param.data = ...`, `set_`, a KV cache re-allocated) leaves the graph
reading the old memory: stale output, or a use-after-free once the allocator hands that memory
out again. The guard catches both ways a tensor moves, on every replay, at a cost that does not
grow with a walk of the module tree:

| what moved | how it is caught | cost per replay |
|---|---|---|
| a parameter, buffer or submodule of the model replaced | module registration hooks flag it | O(1) |
| the storage under a recorded tensor (`.data =`, `set_`) | `data_ptr` compared with capture's | a C call per tensor |
| a `register_static` name given a tensor at another address | flagged when registered | O(1) |

Tensors a model reads that are not parameters or buffers of its `nn.Module` tree (a KV cache in
a plain list, a plain tensor attribute, anything of a non-Module model) are invisible to it unless
registered with `CaptureManager.register_static`. Once something moved, every replay is refused
with `StaticInputMovedError` until the next `capture()`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from graphcap.errors import StaticInputMovedError

__all__ = ["StaticGuard"]

_FIX = "write new values into the captured tensor in place (copy_), or call capture() again"
_data_ptr = torch.Tensor.data_ptr


class StaticGuard:
    """Records the static tensors of one manager's graphs and refuses replays once one moved.

    Not thread-safe on its own: the manager calls it under its lock. Registration hooks are
    process-wide (torch offers no per-module ones) and removed by `disarm` (or when the guard is
    garbage-collected); a hook ignores every module outside the captured model's tree.
    """

    def __init__(self) -> None:
        self.registered: dict[str, torch.Tensor] = {}
        """Tensors given to `register`, by name (kept across captures)."""
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._moved: StaticInputMovedError | None = None
        self._paths: dict[int, str] = {}  # id(module) -> dotted path, the captured model tree
        self._modules: list[nn.Module] = []  # keeps the ids in _paths meaningful
        self._handles: list[Any] = []
        self._finalizer: weakref.finalize | None = None

    @property
    def is_armed(self) -> bool:
        return bool(self._names)

    def register(self, name: str, tensor: torch.Tensor) -> None:
        """Add `tensor` to the static inputs under `name` (see `CaptureManager.register_static`)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_static: name must be a non-empty string; got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_static({name!r}, ...): expected a torch.Tensor; got {type(tensor).__name__}")
        key = f"static.{name}"
        if key in self._names:
            index = self._names.index(key)
            if _data_ptr(tensor) != self._ptrs[index]:
                self._flag(
                    key,
                    f"static input {key!r} was registered again with a tensor at another address "
                    f"(data_ptr {self._ptrs[index]:#x} at capture, {_data_ptr(tensor):#x} now); "
                    "the graphs still read the old one: call capture() again",
                    self._ptrs[index],
                    _data_ptr(tensor),
                )
        elif self._names:
            # Registered after capture: checked from now on at its current address.
            self._names.append(key)
            self._tensors.append(tensor)
            self._ptrs.append(_data_ptr(tensor))
        self.registered[name] = tensor

    def collect(self, model: Any, staging: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every static input by name: the staging views, the model's parameters and buffers, the registered."""
        tensors = dict(staging)
        if isinstance(model, nn.Module):
            tensors.update({f"model.{n}": t for n, t in model.named_parameters(remove_duplicate=False)})
            tensors.update({f"model.{n}": t for n, t in model.named_buffers(remove_duplicate=False)})
        tensors.update({f"static.{n}": t for n, t in self.registered.items()})
        return tensors

    def arm(self, statics: Mapping[str, torch.Tensor], model: Any) -> None:
        """Record `statics` (from `collect`) and watch `model`'s module tree for replacements."""
        self.disarm()
        self._names = list(statics)
        self._tensors = list(statics.values())
        self._ptrs = [_data_ptr(t) for t in self._tensors]
        if isinstance(model, nn.Module):
            named = list(model.named_modules(remove_duplicate=False))
            self._modules = [m for _, m in named]
            self._paths = {id(m): f"model.{n}" if n else "model" for n, m in named}
            me = weakref.ref(self)
            self._handles = [
                _module.register_module_parameter_registration_hook(_hook(me, "_parameters", "parameter")),
                _module.register_module_buffer_registration_hook(_hook(me, "_buffers", "buffer")),
                _module.register_module_module_registration_hook(_hook(me, "_modules", "submodule")),
            ]
            self._finalizer = weakref.finalize(self, _remove, list(self._handles))

    def disarm(self) -> None:
        """Forget the recorded tensors and stop watching (before a new capture, on reset)."""
        if self._finalizer is not None:
            self._finalizer()  # removes the hooks, once
            self._finalizer = None
        self._handles = []
        self._names, self._tensors, self._ptrs = [], [], []
        self._paths, self._modules = {}, []
        self._moved = None

    def check(self, *, sweep: bool = True) -> None:
        """Raise `StaticInputMovedError` if any recorded static input moved since capture.

        `sweep=False` skips the per-tensor `data_ptr` comparison and checks only what was flagged
        when it happened (replacements, re-registrations): O(1).
        """
        if self._moved is not None:
            raise self._moved
        if sweep and list(map(_data_ptr, self._tensors)) != self._ptrs:
            for name, tensor, recorded in zip(self._names, self._tensors, self._ptrs):
                current = _data_ptr(tensor)
                if current != recorded:
                    self._flag(
                        name,
                        f"static input {name!r} moved after capture: data_ptr {recorded:#x} at capture, "
                        f"{current:#x} now (its storage was replaced: .data =, set_, resize_); the graphs "
                        f"read the old memory; {_FIX}",
                        recorded,
                        current,
                    )
                    raise self._moved

    def _flag(self, name: str, message: str, recorded: int | None, current: int | None) -> None:
        if self._moved is None:  # the first move is the one to report
            self._moved = StaticInputMovedError(message, name, recorded, current)

    def _replaced(self, module: nn.Module, slot: str, what: str, name: str, value: Any) -> None:
        path = self._paths.get(id(module))
        if path is None or getattr(module, slot).get(name) is value:
            return  # not our model, or the same object assigned again
        dotted = f"{path}.{name}"
        recorded = next((p for n, p in zip(self._names, self._ptrs) if n == dotted), None)
        current = _data_ptr(value) if isinstance(value, torch.Tensor) else None
        self._flag(
            dotted,
            f"{what} {dotted!r} was replaced by another object after capture; the graphs read the old "
            f"one (stale weights, or freed memory on CUDA); {_FIX}",
            recorded,
            current,
        )


def _hook(guard: weakref.ref, slot: str, what: str):
    def hook(module: nn.Module, name: str, value: Any) -> None:
        me = guard()
        if me is not None:
            me._replaced(module, slot, what, name, value)

    return hook


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
