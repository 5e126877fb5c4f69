"""`StaticGuard`: the tensors a graph reads in place, recorded at capture and checked around every replay.

A CUDA graph holds raw addresses, shapes and strides. A static tensor that changes after
capture leaves the graph reading the old memory: stale output, or a use-after-free once the
allocator hands that memory out again. `graphcap.checks.statics.reach` lists what the model reaches,
each tensor with its slot (`module._parameters["w"]`, `runner.__dict__["lm_head"]`); the guard
records, at capture, each object's identity, address, shape, strides and version counter, and
refuses a replay (`StaticInputMovedError`, naming the tensor) while any of them differs. Each graph's
recording adds what the model reaches by no declared path (`add_read`, from `graphcap.checks.recorded`: a KV
cache kept as a plain module attribute, named where the model keeps it):

| what changed | how it is seen | cost per replay |
|---|---|---|
| an object replaced in its slot (`model.w = p`, `_parameters["w"] = p`, `runner.x = y`) | identity | C call per slot |
| the storage under a recorded tensor (`.data =`, `set_`, a reallocating `resize_`) | `data_ptr` | C call per tensor |
| shape or strides in place (`resize_`, `set_`, `as_strided_`, `t_`) | version counter, then shape | C call per tensor |
| anything assigned through `nn.Module.__setattr__` | module registration hooks | O(1), before the launch |

A change that puts back exactly what was captured (the same object again, or a tensor at the
same address with the same shape, strides and dtype) is accepted: the graph reads exactly it.
A legal in-place write (`copy_`, a weight update) bumps the version counter only, and is
accepted after its shape and strides are compared. Not seen: `.data =` a view of the same
storage at the same address with another shape (no version bump, same address).

When: tensors the graph may write (everything that is not an `nn.Parameter`: KV caches,
buffers, registered tensors, staging) are checked before the launch, since a graph writing
moved memory corrupts what now lives there. Parameters are read only; their sweep runs right
after the launch (asynchronous on CUDA, so it overlaps the GPU's work), before `execute`
returns: a moved weight raises instead of returning stale output. The emulated backend keeps
the same order. Every replay, at every `checks.invariants` level.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from graphcap.backends.graph import storage_ptr
from graphcap.checks.statics import Reached, reach, reached_modules
from graphcap.errors import StaticInputMovedError
from graphcap.torch_modes import no_torch_function

__all__ = ["StaticGuard"]

_FIX = (
    "write new values into the captured tensor in place (copy_), or call capture() again (under capture.strategy: "
    "lazy, capture() releases the graphs and capture_pending() then captures each key against the new tensors)"
)
_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")
_getitem, _is = operator.getitem, operator.is_


class StaticGuard:
    """Records the static tensors of one manager's graphs and refuses replays while one moved.

    Not thread-safe on its own: the manager calls it under its lock. Registration hooks are
    process-wide (torch offers no per-module ones) and removed by `disarm` (or when the guard is
    garbage-collected); a hook ignores every module outside what the captured model reaches.
    """

    def __init__(self) -> None:
        self.registered: dict[str, torch.Tensor] = {}
        """Tensors given to `register`, by name (kept across captures)."""
        self._before = _Sweep([])  # what the graph may write: checked before the launch
        self._after = _Sweep([])  # parameters, read only: checked after the launch
        self._names: set[str] = set()
        self._armed = False
        self._dirty = False  # a module hook saw an assignment: settle everything before the launch
        self._paths: dict[int, tuple[str, nn.Module]] = {}  # id(module) -> (dotted path, module)
        self._handles: list[Any] = []
        self._finalizer: weakref.finalize | None = None

    @property
    def is_armed(self) -> bool:
        """Whether the guard holds a record (after `arm`, until `disarm`)."""
        return self._armed

    def register(self, name: str, tensor: torch.Tensor) -> None:
        """Add `tensor` to the static inputs under `name` (see `CaptureManager.register_static`).

        `CaptureError` when the tensor has no storage of its own (a wrapper: register its inner tensors).
        """
        self.check_registrable(name, tensor)
        self.registered[name] = tensor
        if self._armed and f"static.{name}" not in self._names:
            # Registered after capture: checked from now on as it is now.
            self._add(self._before, Reached(f"static.{name}", tensor, self.registered, name, "static input"))

    @staticmethod
    def check_registrable(name: str, tensor: torch.Tensor) -> None:
        """What `register` refuses, refused without registering (`resize_kv` checks every tensor before any change).

        `TypeError` for a name that is not a non-empty string or a value that is not a tensor; `CaptureError`
        for a tensor without storage of its own (a sparse tensor, a wrapper: register its inner tensors).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_static: name must be a non-empty string; got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_static({name!r}, ...): expected a torch.Tensor; got {type(tensor).__name__}")
        storage_ptr(tensor, f"static.{name}")

    def collect(self, model: Any, staging: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every static tensor by name: staging, the registered, what the model reaches (`graphcap.checks.statics`)."""
        return {r.name: r.value for r in reach(model, self.registered, staging) if isinstance(r.value, torch.Tensor)}

    def arm(self, model: Any, staging: Mapping[str, torch.Tensor]) -> None:
        """Record what `model` reaches (and `staging`, the registered) as it is now; watch its modules.

        `CaptureError` naming a tensor without storage of its own (an FP8 or torchao wrapper, a
        DTensor): the graph reads the tensors inside it, which must be registered instead.
        """
        self.disarm()
        found = reach(model, self.registered, staging)
        entries = [_Entry(r) for r in found]
        written = {e.name for e in entries if e.ptr is not None and not isinstance(e.value, nn.Parameter)}
        on_the_way = {name.rsplit(".", k)[0] for name in written for k in range(1, name.count(".") + 1)}
        before = [e for e in entries if e.name in written or (e.ptr is None and e.name in on_the_way)]
        chosen = {id(e) for e in before}
        self._before = _Sweep(before)
        self._after = _Sweep([e for e in entries if id(e) not in chosen])
        self._names, self._armed = {e.name for e in entries}, True
        self._paths = reached_modules(model, found)
        if self._paths:
            self._watch()

    def _watch(self) -> None:
        """Install the registration hooks (removed by `disarm`, or when the guard is garbage-collected)."""
        me = weakref.ref(self)
        self._handles = [
            _module.register_module_parameter_registration_hook(_hook(me, "_parameters")),
            _module.register_module_buffer_registration_hook(_hook(me, "_buffers")),
            _module.register_module_module_registration_hook(_hook(me, "_modules")),
        ]
        self._finalizer = weakref.finalize(self, _remove, list(self._handles))

    def check_before_capture(self, what: str, model: Any, staging: Mapping[str, torch.Tensor]) -> None:
        """Before more graphs join the live ones (`capture_pending`): every recorded tensor as the live graphs read it.

        `StaticInputMovedError` naming the first that differs (a graph captured now would read another
        tensor than the graphs before it, and no single record could then check them all). Then records
        what `model` reaches that is not recorded yet (a tensor added since), so every live graph's static
        inputs are the one record this guard checks. Nothing to do while disarmed (no live graph).
        """
        if not self._armed:
            return
        try:
            self.check()
        except StaticInputMovedError as exc:
            raise StaticInputMovedError(
                f"{what}: refused to capture: {exc}. The live graphs read what they captured: a graph captured "
                "now would read another tensor beside them (wrong output once the captured one is put back)",
                exc.input_name,
                exc.recorded_ptr,
                exc.current_ptr,
            ) from None
        found = [r for r in reach(model, self.registered, staging) if r.name not in self._names]
        if not found:
            return
        for r in found:  # parameters and objects on the way: after the launch; what the graph may write: before it
            written = isinstance(r.value, torch.Tensor) and not isinstance(r.value, nn.Parameter)
            (self._before if written else self._after).entries.append(_Entry(r))
            self._names.add(r.name)
        self._before.index()
        self._after.index()
        for key, value in reached_modules(model, found).items():
            self._paths.setdefault(key, value)
        if self._paths and not self._handles:
            self._watch()

    def disarm(self) -> None:
        """Forget the recorded tensors and stop watching (before a new capture, on reset)."""
        if self._finalizer is not None:
            self._finalizer()  # removes the hooks, once
            self._finalizer = None
        self._handles = []
        self._before, self._after = _Sweep([]), _Sweep([])
        self._names, self._paths = set(), {}
        self._armed = self._dirty = False

    def check_before_replay(self) -> None:
        """Raise `StaticInputMovedError` if a tensor the graph may write changed (or a hook saw an assignment)."""
        if self._dirty:
            self._before.settle()
            self._after.settle()
            self._dirty = False
        elif not self._before.holds():
            self._before.settle()

    def check_after_replay(self) -> None:
        """Raise `StaticInputMovedError` if a parameter (read only) changed: run it before using the output."""
        if not self._after.holds():
            self._after.settle()

    def check(self) -> None:
        """Both checks, back to back: every recorded tensor and slot as at capture."""
        self.check_before_replay()
        self.check_after_replay()

    def recorded_ids(self) -> set[int]:
        """The identities of every recorded tensor and object (what `add_read` need not add again)."""
        return {id(e.value) for e in (*self._before.entries, *self._after.entries)}

    def add_read(self, reached: Reached) -> None:
        """Record a tensor a captured graph reads, found from its recording (`graphcap.checks.recorded`): checked
        from now on as it is now, before the launch (after it for an `nn.Parameter`, read only)."""
        if reached.name not in self._names:
            self._add(self._after if isinstance(reached.value, nn.Parameter) else self._before, reached)

    def _add(self, sweep: _Sweep, reached: Reached) -> None:
        sweep.entries.append(_Entry(reached))
        sweep.index()
        self._names.add(reached.name)

    def _assigned(self, module: nn.Module, slot: str, name: str, value: Any) -> None:
        if id(module) in self._paths and getattr(module, slot).get(name) is not value:
            self._dirty = True  # the same object assigned again is no change


class _Entry:
    """One reached tensor (or object on the way to one) and what it was at capture."""

    __slots__ = ("container", "dtype", "key", "name", "ptr", "shape", "stride", "value", "version", "what")

    def __init__(self, reached: Reached) -> None:
        self.name, self.value, self.container, self.key, self.what = reached
        self.ptr: int | None = None
        self.shape: tuple[int, ...] | None = None
        self.stride: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.version: int | None = None
        if isinstance(self.value, torch.Tensor):
            self._record(self.value)

    def _record(self, tensor: torch.Tensor) -> None:
        self.value = tensor
        self.ptr = storage_ptr(tensor, self.name)
        self.shape, self.stride, self.dtype = tuple(tensor.shape), tensor.stride(), tensor.dtype
        try:
            self.version = tensor._version
        except RuntimeError:  # an inference tensor keeps no version counter: compared in full instead
            self.version = None

    def same_place(self) -> bool:
        """Same address, shape and strides (for tensors without a version counter)."""
        t = self.value
        return _data_ptr(t) == self.ptr and t.shape == self.shape and t.stride() == self.stride

    def settle(self) -> bool:
        """Raise if this entry moved; accept (and record) a harmless change. True: another object now."""
        current = self.value
        if self.container is not None:
            try:
                current = self.container[self.key]
            except LookupError:
                raise StaticInputMovedError(
                    f"{self.what} {self.name!r} was removed after capture; the graphs still read it; {_FIX}",
                    self.name,
                    self.ptr,
                    None,
                ) from None
        if self.ptr is None:  # a module or plain object on the way to tensors
            if current is not self.value:
                raise self._replaced(current, None)
            return False
        if not isinstance(current, torch.Tensor):
            raise self._replaced(current, None)
        ptr = storage_ptr(current, self.name)
        same = (ptr, tuple(current.shape), current.stride(), current.dtype) == (
            self.ptr,
            self.shape,
            self.stride,
            self.dtype,
        )
        if current is not self.value and not same:
            raise self._replaced(current, ptr)
        if ptr != self.ptr:
            raise StaticInputMovedError(
                f"static input {self.name!r} moved after capture: data_ptr {self.ptr:#x} at capture, {ptr:#x} now "
                f"(its storage was replaced: .data =, set_, resize_); the graphs read the old memory; {_FIX}",
                self.name,
                self.ptr,
                ptr,
            )
        if not same:
            raise StaticInputMovedError(
                f"static input {self.name!r} changed in place after capture: shape {list(self.shape or ())}, strides "
                f"{self.stride}, {self.dtype} at capture; {list(current.shape)}, {current.stride()}, "
                f"{current.dtype} now, at the same address (resize_, set_, as_strided_ or an in-place view op); "
                f"the graphs still read the captured shape; {_FIX}",
                self.name,
                self.ptr,
                ptr,
            )
        replaced = current is not self.value
        self._record(current)  # the same place: an in-place write, or the captured tensor put back
        return replaced

    def _replaced(self, current: Any, ptr: int | None) -> StaticInputMovedError:
        if self.what == "static input" and self.container is not None:
            message = (
                f"static input {self.name!r} was registered again with a tensor at another address or shape "
                f"(data_ptr {self.ptr or 0:#x}, shape {list(self.shape or ())} at capture; "
                + (f"{ptr:#x}, {list(current.shape)} now" if ptr is not None else f"a {type(current).__name__} now")
                + "); the graphs still read the old one: register the captured tensor again, or call capture() again "
                "(under capture.strategy: lazy, capture() releases the graphs and capture_pending() then captures "
                "each key against the new tensor)"
            )
        else:
            message = (
                f"{self.what} {self.name!r} was replaced by another object after capture; the graphs read the old "
                f"one (stale weights, or freed memory on CUDA); put the captured object back, {_FIX}"
            )
        return StaticInputMovedError(message, self.name, self.ptr, ptr)


class _Sweep:
    """A group of entries, checked in a few C-level passes over parallel lists (`holds`)."""

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self.index()

    def index(self) -> None:
        """Rebuild the parallel lists from the entries (after `settle` recorded a change)."""
        slotted = [e for e in self.entries if e.container is not None]
        self.containers, self.keys = [e.container for e in slotted], [e.key for e in slotted]
        self.held = [e.value for e in slotted]
        self.versioned = [e for e in self.entries if e.version is not None]
        self.tensors = [e.value for e in self.versioned]
        self.ptrs = [e.ptr for e in self.versioned]
        self.versions: list[int | None] = [e.version for e in self.versioned]
        self.exact = [e for e in self.entries if e.ptr is not None and e.version is None]

    def holds(self) -> bool:
        """True when every slot holds its object and every tensor its address, shape and strides.

        Three C-level passes (identity, `data_ptr`, version counter); only a tensor whose version
        moved on (an in-place write: a KV cache on every emulated replay, a weight update) has its
        shape and strides read.
        """
        try:
            with no_torch_function():  # an engine's torch modes would see (and slow) every data_ptr call
                if not all(map(_is, map(_getitem, self.containers, self.keys), self.held)):
                    return False
                if list(map(_data_ptr, self.tensors)) != self.ptrs:
                    return False
                versions = list(map(_version, self.tensors))
                if versions != self.versions and not self._written_in_place(versions):
                    return False
                return not self.exact or all(e.same_place() for e in self.exact)
        except (LookupError, TypeError, RuntimeError):  # a slot emptied, or holding something else now
            return False

    def _written_in_place(self, versions: list[int | None]) -> bool:
        """Whether every tensor whose version moved on kept its shape and strides (then its version is recorded)."""
        changed = [i for i, (now, then) in enumerate(zip(versions, self.versions)) if now != then]
        for i in changed:
            entry = self.versioned[i]
            if entry.value.shape != entry.shape or entry.value.stride() != entry.stride:
                return False
        for i in changed:
            self.versioned[i].version = versions[i]
        self.versions = versions
        return True

    def settle(self) -> None:
        """Raise `StaticInputMovedError` for the first entry that moved; else record what changed harmlessly."""
        replaced = False
        for entry in self.entries:
            replaced |= entry.settle()
        if replaced:
            self.index()
        else:  # in-place writes only: new version counts
            self.versions = [e.version for e in self.versioned]


def _hook(guard: weakref.ref, slot: str):
    def hook(module: nn.Module, name: str, value: Any) -> None:
        me = guard()
        if me is not None:
            me._assigned(module, slot, name, value)

    return hook


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
