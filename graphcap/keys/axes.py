"""`KeyAxes`: the key axes of a registry (`capture.axes`), their padding tables and combinations.

A key axis is a dimension of the graph key beyond tokens whose value changes the forward's Python
structure (LoRA slots, micro-batches, a draft width). Built once from the config: per axis a padding
table (every value up to the largest -> the smallest captured value at or above it), and per padded
combination of values the planned combination that holds it (itself, or with `capture.axis_combinations`
the listed one with the fewest padded slots). `KeyRegistry` reads these on the dispatch hot path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import NoReturn

from graphcap.errors import BatchError

__all__ = ["KeyAxes"]


class KeyAxes:
    """Captured values per axis (`values`), padding tables, defaults and the planned combinations."""

    def __init__(self, axes: Mapping[str, Iterable[int]] | None, combinations: Iterable[Mapping[str, int]] = ()):
        self.values: dict[str, tuple[int, ...]] = {name: tuple(v) for name, v in (axes or {}).items()}
        """Each axis's captured values, ascending (empty: no axes)."""
        self.names = tuple(self.values)
        self.defaults = tuple((name, values[0]) for name, values in self.values.items())
        """Every axis at its smallest value: a step's values where it states none."""
        self.floors = tuple(values[0] for values in self.values.values())
        self.index = {name: i for i, name in enumerate(self.names)}
        self.tables = tuple(_padding_table(values) for values in self.values.values())
        """Per axis, every value `0..largest` -> the smallest captured value at or above it."""
        every = [tuple(values) for values in itertools.product(*self.values.values())]
        declared = sorted({tuple(c[name] for name in self.names) for c in combinations}) or every
        self.planned = [tuple(zip(self.names, values)) for values in declared]
        """The combinations to capture, as `GraphKey.axes` (all of them, or those listed)."""
        self.holder: dict[tuple[int, ...], tuple[tuple[str, int], ...]] = {}
        """Each combination of padded values -> the planned combination that replays it (absent: none holds it)."""
        for values in every:
            holders = [d for d in declared if all(h >= v for h, v in zip(d, values))]
            if holders:
                self.holder[values] = tuple(zip(self.names, min(holders, key=lambda d: (self._slots(d), d))))

    def _slots(self, values: Iterable[int]) -> int:
        """Positions of `values` among their axes' captured values, summed (a combination's padded slots)."""
        return sum(self.values[name].index(value) for name, value in zip(self.names, values))

    def of_step(self, axes: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
        """A step's value of every axis, `(name, value)` in the config's order (a missing axis: its smallest
        value); `BatchError` naming an axis `capture.axes` does not plan, and the axes it plans."""
        if not axes:
            return self.defaults
        for name in axes:
            if name not in self.values:
                self.refuse_unplanned(name)
        return tuple([(name, axes.get(name, floor)) for name, floor in self.defaults])

    def refuse_unplanned(self, name: str) -> NoReturn:
        """`BatchError` for a step naming axis `name`, which `capture.axes` does not plan; it names the planned ones."""
        planned = ", ".join(self.names) or "none"
        raise BatchError(
            f"axes names {name!r}, which capture.axes does not plan (its axes: {planned}); "
            f"add it to capture.axes or leave it out of StepBatch(axes=...)"
        )


def _padding_table(values: tuple[int, ...]) -> list[int]:
    """Every value `0..values[-1]` -> the smallest of `values` (ascending) at or above it."""
    table, low = [], 0
    for value in values:
        table += [value] * (value + 1 - low)
        low = value + 1
    return table
