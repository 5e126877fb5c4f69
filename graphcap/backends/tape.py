"""The aten op tape behind the emulated backend: record a forward once, replay the ops.

`TapeRecorder` (a `TorchDispatchMode`, also the unsafe-op checker) keeps every op a
forward runs. `compile_tape` turns the records into a `Tape`:

- A tensor an op receives that no earlier op produced (weight, persistent buffer, KV
  cache) is an external. The tape holds an alias of it over the storage it had at
  capture, as a CUDA graph holds its address: in-place writes reach the original, but a
  later `param.data = new` (or `set_`) swap is not seen, exactly as on CUDA. A tensor made
  by an op is a slot; any other argument is a constant, stored once in the step's
  argument template.
- Each step calls the op through `bindings.native_binding` (the native Python binding
  that reaches exactly the recorded overload), else through the `OpOverload`; this keeps
  replay as fast as the eager forward.
- Slot liveness is computed once: a slot is dropped after its last reader, an output no
  step reads is never stored, and the peak of live slot storages is `peak_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphcap.backends.bindings import native_binding
from graphcap.backends.collectives import is_async, observed, unwrap_async
from graphcap.backends.preflight import UnsafeOpMode
from graphcap.backends.reads import ExternalReads
from graphcap.errors import CaptureError

__all__ = ["Tape", "TapeRecorder", "compile_tape"]

_Builder = Callable[[list], tuple[Sequence[Any], dict]]
# One replay step: (op, args, kwargs, fills, build, out, multi_out, frees).
#   fills: ((arg position, slot), ...) for tensors made on the tape, at the top level of args
#   build: None, or rebuilds (args, kwargs) when slots sit in lists or kwargs (cat, index)
#   out: slot for a single tensor output (-1: not stored); multi_out: ((index, slot), ...)
#   frees: slots whose last use is this step
_Step = tuple[Any, Sequence[Any], dict, tuple, "_Builder | None", int, "tuple | None", tuple]


class _Raw(NamedTuple):
    """One recorded op after templating, before liveness is known."""

    call: Callable  # the native binding, or the OpOverload
    args: list  # positional template (None where a slot goes)
    kwargs: dict
    fills: list  # [(position, slot)] at the top level of args
    nested: list  # [(position, list template, ((index, slot), ...))]
    kw_fills: list
    kw_nested: list
    made: list  # [(index in the output or -1, new slot)]


class TapeRecorder(UnsafeOpMode):
    """Checks and records every aten op; the records keep every tensor seen alive. `reads` collects the
    externals as the ops receive them (`ExternalReads`: what the backend's graph reports as `reads`)."""

    def __init__(self, device: torch.device, reads: ExternalReads | None = None) -> None:
        super().__init__(device, reads)
        self.records: list[tuple[Any, tuple, dict, Any]] = []

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = unwrap_async(self.records, args, kwargs)  # funcol's AsyncCollectiveTensor: see collectives
        out = func(*args, **kwargs)
        if is_async(out):  # funcol wrapping a collective's result: later ops get the tensor inside
            return out
        # Strong references until compilation, so no id() is reused by a new tensor.
        self.records.append((func, args, kwargs, out))
        return out


class Tape:
    """The compiled steps, with slot liveness precomputed; holds externals, no slot values."""

    def __init__(self, steps: list[_Step], num_slots: int, result_slots: tuple[int, ...], peak: int) -> None:
        self.steps = steps
        self.num_slots = num_slots
        self.result_slots = result_slots
        """Per output: the slot holding its value after a run, or -1 (a view of an external
        the steps write in place)."""
        self.peak_bytes = peak

    @property
    def result_slot(self) -> int:
        """The first output's slot (a forward with one output)."""
        return self.result_slots[0]

    def run(self) -> list[torch.Tensor | None]:
        """Execute every step (under inference mode, as recorded); returns each output's value,
        or None for an output that is an external the steps update in place."""
        slots: list[Any] = [None] * self.num_slots
        for op, args, kwargs, fills, build, out, multi_out, frees in self.steps:
            if build is not None:
                args, kwargs = build(slots)
            elif fills:
                filled = list(args)
                for position, slot in fills:
                    filled[position] = slots[slot]
                args = filled
            result = op(*args, **kwargs)
            if out >= 0:
                slots[out] = result
            elif multi_out is not None:
                for index, slot in multi_out:
                    slots[slot] = result[index]
            for slot in frees:
                slots[slot] = None
        return [slots[slot] if slot >= 0 else None for slot in self.result_slots]


class _Compiler:
    """Turns recorded (op, args, kwargs, out) into `Tape` steps: one pass, then liveness."""

    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}  # id(tensor made on the tape) -> slot
        self.slot_tensors: list[torch.Tensor] = []  # capture-time values, for memory only
        self.made_at: list[int] = []  # slot -> step that produced it
        self.last_use: list[int] = []  # slot -> last step that reads it (made_at: none does)
        self.external_ids: set[int] = set()
        self.external_storages: set[int] = set()
        self.aliases: dict[int, torch.Tensor] = {}  # id(external) -> alias over its capture storage
        self.slot_storages: set[int] = set()  # storages first allocated by an op on the tape

    def compile(self, records: list[tuple[Any, tuple, dict, Any]], outputs: list[torch.Tensor]) -> Tape:
        raw = []
        for step, (func, args, kwargs, out) in enumerate(records):
            args_t, fills, nested = self._template(func, args, step)
            kwargs_t: dict[str, Any] = {}  # most ops: nothing to template
            kw_fills: list[Any] = []
            kw_nested: list[Any] = []
            if kwargs:
                kw_values, kw_fills, kw_nested = self._template(func, kwargs, step)
                kwargs_t = dict(zip(kwargs, kw_values))
            made = self._outputs(func, out, step)
            call = observed(func, native_binding(func, args, kwargs) or func)
            raw.append(_Raw(call, args_t, kwargs_t, fills, nested, kw_fills, kw_nested, made))
        result_slots = []
        for output in outputs:
            slot = self.slot_of.get(id(output), -1)
            if slot >= 0 and output.untyped_storage().data_ptr() in self.external_storages:
                slot = -1  # a view of an external: the replayed writes land in it already
            if slot >= 0:
                self.last_use[slot] = len(records)  # read by the copy into the output
            result_slots.append(slot)
        frees_at: list[list[int]] = [[] for _ in records]
        for slot, step in enumerate(self.last_use):
            if step < len(records):
                frees_at[step].append(slot)
        steps = [self._step(step, frees_at[step], entry) for step, entry in enumerate(raw)]
        return Tape(steps, len(self.slot_tensors), tuple(result_slots), self._peak_bytes(raw, frees_at))

    def _use(self, func: Any, value: Any, step: int) -> int | None:
        """Slot of a tensor input (marking the use), or None for an external or a constant."""
        if not isinstance(value, torch.Tensor):
            return None
        slot = self.slot_of.get(id(value))
        if slot is not None:
            self.last_use[slot] = step
        elif id(value) not in self.external_ids:
            storage = value.untyped_storage().data_ptr()
            if storage in self.slot_storages:
                raise CaptureError(
                    f"{func} received a tensor that shares memory with an intermediate of this "
                    "forward but was not made by an aten op (e.g. Tensor.as_subclass); a "
                    "replay would read its capture-time values. Make it with an aten op "
                    "(view, detach, clone)"
                )
            self.external_ids.add(id(value))
            self.external_storages.add(storage)
        return slot

    def _template(self, func: Any, values: tuple | dict, step: int) -> tuple[list, list, list]:
        """(template, top-level fills, nested fills) for positional args or kwargs.

        Slot positions hold None in the template, so the tape keeps no capture-time slot.
        """
        keys = list(values) if isinstance(values, dict) else range(len(values))
        template, fills, nested = [], [], []
        for key in keys:
            value = values[key]
            if isinstance(value, torch.Tensor):
                slot = self._use(func, value, step)
                if slot is not None:
                    fills.append((key, slot))
                    value = None
                else:
                    value = self._alias(value)
            elif isinstance(value, (list, tuple)):
                slots = [(j, self._use(func, v, step)) for j, v in enumerate(value)]
                inner = [(j, s) for j, s in slots if s is not None]
                if inner:
                    filled = {j for j, _ in inner}
                    inner_t = [None if j in filled else self._alias(v) for j, v in enumerate(value)]
                    nested.append((key, inner_t, tuple(inner)))
                    value = None
                elif any(isinstance(v, torch.Tensor) for v in value):
                    value = type(value)(self._alias(v) for v in value)
            template.append(value)
        return template, fills, nested

    def _alias(self, value: Any) -> Any:
        """The tape's stand-in for an external tensor: same storage, same view, its own identity.

        `detach()` makes a new tensor over the storage the external has now; swapping the
        external's storage later (`.data =`, `set_`) changes the external, not the alias.
        """
        if not isinstance(value, torch.Tensor):
            return value
        alias = self.aliases.get(id(value))
        if alias is None:
            alias = self.aliases[id(value)] = value.detach()
        return alias

    def _outputs(self, func: Any, out: Any, step: int) -> list[tuple[int, int]]:
        """(index in the output or -1 for a lone tensor, new slot) for tensors new to the tape.

        An in-place op returns its input: that tensor keeps its slot or stays external.
        """
        if isinstance(out, torch.Tensor):
            leaves = [(-1, out)]
        elif isinstance(out, (list, tuple)):
            leaves = list(enumerate(out))
        else:
            return []  # None or a Python scalar (a frozen metadata query)
        made = []
        slot_of, external_ids = self.slot_of, self.external_ids
        for index, value in leaves:
            if not isinstance(value, torch.Tensor):
                if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                    raise CaptureError(
                        f"{func} returns tensors nested in a {type(value).__name__}; the emulated "
                        "backend cannot replay that op; keep it out of the captured forward"
                    )
                continue
            identity = id(value)
            if identity in slot_of or identity in external_ids:
                continue
            slot = slot_of[identity] = len(self.slot_tensors)
            self.slot_tensors.append(value)
            self.made_at.append(step)
            self.last_use.append(step)
            made.append((index, slot))
            storage = value.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in self.external_storages:
                self.slot_storages.add(storage.data_ptr())
        return made

    def _step(self, step: int, frees: list[int], raw: _Raw) -> _Step:
        # A slot no later step reads is not stored: it dies with the op's return value.
        stored = [(index, slot) for index, slot in raw.made if self.last_use[slot] > step]
        out = stored[0][1] if len(stored) == 1 and stored[0][0] == -1 else -1
        multi_out = tuple(stored) if stored and out < 0 else None
        freed = tuple(slot for slot in frees if self.made_at[slot] < step)
        build = None
        if raw.nested or raw.kw_fills or raw.kw_nested:
            build = _builder(raw)
        args, fills = tuple(raw.args), tuple(raw.fills)
        return (raw.call, args, raw.kwargs, fills, build, out, multi_out, freed)

    def _peak_bytes(self, raw: list, frees_at: list[list[int]]) -> int:
        """Peak bytes of slot storages alive at once during a replay (externals excluded)."""
        storages = [tensor.untyped_storage() for tensor in self.slot_tensors]
        sizes = [(storage.data_ptr(), storage.nbytes()) for storage in storages]  # each slot's, read once
        live: dict[int, int] = {}  # storage data_ptr -> number of live slots viewing it
        current = peak = 0
        for step, entry in enumerate(raw):
            for _, slot in entry.made:
                current += self._storage_delta(sizes[slot], live, +1)
            peak = max(peak, current)
            for slot in frees_at[step]:
                current += self._storage_delta(sizes[slot], live, -1)
        return peak

    def _storage_delta(self, size: tuple[int, int], live: dict[int, int], sign: int) -> int:
        key, nbytes = size
        if key in self.external_storages:
            return 0
        count = live.get(key, 0) + sign
        live[key] = count
        is_edge = count == 1 if sign > 0 else count == 0
        return sign * nbytes if is_edge else 0


def _builder(raw: _Raw) -> _Builder:
    """Rebuild (args, kwargs) when tape slots sit inside lists (cat, index) or in kwargs."""
    fills, nested, kw_fills, kw_nested = raw.fills, raw.nested, raw.kw_fills, raw.kw_nested
    args_t, kwargs_t = tuple(raw.args), raw.kwargs

    def build(slots: list) -> tuple[list, dict]:
        args = list(args_t)
        kwargs = dict(kwargs_t)
        for target, top, deep in ((args, fills, nested), (kwargs, kw_fills, kw_nested)):
            for key, slot in top:
                target[key] = slots[slot]
            for key, values, inner in deep:
                values = list(values)
                for index, slot in inner:
                    values[index] = slots[slot]
                target[key] = values
        return args, kwargs

    return build


def compile_tape(records: list[tuple[Any, tuple, dict, Any]], outputs: list[torch.Tensor]) -> Tape:
    """Compile `TapeRecorder.records` for a forward whose results (or exported tensors) are `outputs`.

    Must run under the grad mode of the recording (inference mode) while the records are
    still alive (identities are keyed by `id()`). The tape references externals and
    constants only; the caller drops the records afterwards.
    """
    return _Compiler().compile(records, list(outputs))
