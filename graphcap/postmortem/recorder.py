"""`FlightRecorder`: the host rows of the last K staged steps, kept for a post-mortem.

Every staging the manager uploads (a real step's, a capture's dummy batch, a verification's probe)
is copied into the next slot of a ring of `K` preallocated byte rows: the rows of the key's padded
shape of every packed field (the built-ins, the step counts, the engine buffers, the KV-cache groups'
rows), one `np.concatenate(..., out=)` into the slot. No allocation per step beyond the slot's small
record tuple, no torch call. What a slot holds is read back by `steps()` when an error leaves a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from graphcap.phases import phase
from graphcap.staging.layout import PackedLayout

__all__ = ["FlightRecorder", "RecordedStep", "Span"]

_MAX_PLANS = 1024
_MODES = {"full": "replay"}  # `Mode.FULL` replays the whole graph
_concatenate = np.concatenate


class Span(NamedTuple):
    """Where one packed field's recorded bytes lie in a slot."""

    name: str
    start: int
    """Offset in the slot."""
    nbytes: int
    """Bytes recorded: from the field's first byte to one past the last byte of the shape's rows."""


class _Plan(NamedTuple):
    sources: list[np.ndarray]  # byte views of the packed host buffer, one per field
    targets: list[np.ndarray]  # per slot: the slot's first `sum(nbytes)` bytes
    spans: tuple[Span, ...]
    shape: tuple[int, int]  # (T, R)


class RecordedStep(NamedTuple):
    """One staged step as the recorder kept it (oldest first from `FlightRecorder.steps`)."""

    step: int | None
    """The `execute` step it belongs to (the recorder's count, from 1), None for a capture's own batches."""
    key: Any
    """The key it was staged for (with peers: the agreed key)."""
    mode: str
    """`replay` (a full graph), `piecewise` (a replay of pieces), `eager`, or `capture` (a capture pass's batch)."""
    reason: str
    """Why it ran eagerly (an `EAGER_REASONS` key), "" otherwise."""
    phase: str
    """`graphcap.phase()` while it was staged: `replay`, `eager`, `capture`, `verify`."""
    num_tokens: int
    num_reqs: int
    shape: tuple[int, int]
    """The padded `(T, R)` of the rows."""
    dummy: bool
    """A batch graphcap made (or one without a block table): the null-block rules are not checked for it."""
    kv_writes: bool
    """False: a verification batch that writes no KV slot."""
    spans: tuple[Span, ...]
    rows: np.ndarray
    """The recorded bytes (a copy: the slot may be reused)."""


class FlightRecorder:
    """A ring of the last `num_steps` stagings of one `PersistentBuffers` layout.

    `note(mode, reason)` before a real step's staging tells its mode; `record(inputs, ...)` after
    the rows are checked copies them. Not thread-safe: the manager's lock holds around both.
    """

    __slots__ = ("_count", "_meta", "_mode", "_next", "_packed", "_plans", "_reason", "_rows", "_step", "layout",
                 "num_steps")  # fmt: skip

    def __init__(self, layout: PackedLayout, num_steps: int) -> None:
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"FlightRecorder: num_steps must be an int >= 1; got {num_steps!r}")
        self.layout = layout
        self.num_steps = num_steps
        self._packed = layout.packed
        self._rows = np.zeros((num_steps, layout.packed.nbytes), np.uint8)  # [K, packed bytes]
        self._meta: list[tuple | None] = [None] * num_steps
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._next = 0
        self._count = 0
        self._step = 0
        self._mode: str | None = None
        self._reason = ""

    def note(self, mode: Any, reason: str) -> None:
        """The next staging is step `n + 1` of `execute`, run in `mode` (`Mode`) for `reason`."""
        self._step += 1
        self._mode = mode
        self._reason = reason

    def record(self, inputs: Any, dummy: bool, kv_writes: bool) -> None:
        """Copy the staged rows of `inputs` (a `ForwardInputs` just checked, about to be uploaded)."""
        T, R = inputs.key.num_tokens, len(inputs.host.seq_lens)
        plan = self._plans.get((T, R))
        if plan is None:
            plan = self._plan(T, R)
        slot = self._next
        _concatenate(plan.sources, out=plan.targets[slot])
        mode = self._mode
        meta: tuple[Any, ...]
        if mode is None:
            meta = (
                None,
                inputs.key,
                "capture",
                "",
                phase(),
                inputs.num_tokens,
                inputs.num_reqs,
                plan,
                dummy,
                kv_writes,
            )
        else:
            meta = (self._step, inputs.key, mode, self._reason, phase(), inputs.num_tokens, inputs.num_reqs, plan,
                    dummy, kv_writes)  # fmt: skip
            self._mode = None
        self._meta[slot] = meta
        self._next = slot + 1 if slot + 1 < self.num_steps else 0
        self._count += 1

    @property
    def num_recorded(self) -> int:
        """Stagings recorded since the start (the ring holds the last `num_steps` of them)."""
        return self._count

    def steps(self) -> Iterator[RecordedStep]:
        """The recorded stagings, oldest first."""
        for i in range(self.num_steps):
            slot = (self._next + i) % self.num_steps
            meta = self._meta[slot]
            if meta is None:
                continue
            step, key, mode, reason, phase_, n, r, plan, dummy, kv_writes = meta
            total = sum(span.nbytes for span in plan.spans)
            rows = self._rows[slot, :total].copy()
            mode = _MODES.get(str(mode), str(mode))
            yield RecordedStep(step, key, mode, reason, phase_, n, r, plan.shape, dummy, kv_writes, plan.spans, rows)

    def _plan(self, T: int, R: int) -> _Plan:
        if len(self._plans) >= _MAX_PLANS:
            del self._plans[next(iter(self._plans))]
        views = self.layout.views(T, R).host
        sources, spans, start = [], [], 0
        for entry in self.layout.entries:
            offset = self.layout.offsets[entry.name]
            view = views[entry.name]
            stop = offset if view.size == 0 else offset + sum((d - 1) * s for d, s in zip(view.shape, view.strides))
            stop += view.itemsize if view.size else 0
            sources.append(self._packed[offset:stop])
            spans.append(Span(entry.name, start, stop - offset))
            start += stop - offset
        targets = [self._rows[slot, :start] for slot in range(self.num_steps)]
        plan = _Plan(sources, targets, tuple(spans), (T, R))
        self._plans[(T, R)] = plan
        return plan
