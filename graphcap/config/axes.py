"""`capture.axes`: key axes beyond tokens (LoRA capacity, micro-batches, draft widths), validated.

An axis is a dimension of the graph key whose value changes the forward's Python-level structure (a
loop over adapter slots, a split into micro-batches), so each captured value is a graph of its own per
token key; a step pads to the smallest captured value at or above its own (`graphcap.keys.KeyRegistry`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from graphcap.config._schema import problem
from graphcap.errors import ConfigProblem

__all__ = [
    "AXIS_RESERVED",
    "MAX_AXES",
    "MAX_AXIS_COMBINATIONS",
    "MAX_AXIS_VALUE",
    "axes_problems",
    "combination_problems",
]

MAX_AXES = 4
"""Most axes `capture.axes` may name: data-parallel ranks agree on every axis in one reduction."""
MAX_AXIS_VALUE = 1 << 16
"""Largest value of an axis: its padding table holds one entry per value."""
MAX_AXIS_COMBINATIONS = 1024
"""Most combinations of axis values `capture.axes` may plan (each one a graph per token key)."""
AXIS_RESERVED = ("tokens", "reqs", "num_tokens", "num_reqs", "uniform", "piecewise")
"""Names an axis may not take: a key prints them already (`uniform(tokens=4, reqs=4, lora=2)`)."""


def axes_problems(axes: Mapping) -> list[ConfigProblem]:
    """Every problem of `capture.axes`, each under its axis's dotted key (`capture.axes.lora`) with the fix."""
    out = []
    if len(axes) > MAX_AXES:
        names = ", ".join(map(str, axes))
        why = "data-parallel ranks agree on every axis in one reduction"
        out.append(problem("capture.axes", f"names {len(axes)} axes ({names}); at most {MAX_AXES}: {why}"))
    for name, values in axes.items():
        key = f"capture.axes.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            use = "use a Python identifier such as lora (it names inputs.axes[...] and StepBatch(axes={...}))"
            out.append(problem(key, f"{name!r} is not an axis name: {use}"))
            continue
        if name in AXIS_RESERVED:
            shown = ", ".join(AXIS_RESERVED)
            out.append(problem(key, f"{name!r} is reserved (keys print {shown}); rename the axis, e.g. {name}_axis"))
        out += _value_problems(key, values)
    if not out:
        combinations = math.prod(len(v) for v in axes.values())
        if combinations > MAX_AXIS_COMBINATIONS:
            counts = " x ".join(f"{len(v)} ({n})" for n, v in axes.items())
            message = f"plans {counts} = {combinations} combinations of values, above {MAX_AXIS_COMBINATIONS}"
            out.append(problem("capture.axes", f"{message}; capture fewer values"))
    return out


def _value_problems(key: str, values: object) -> list[ConfigProblem]:
    """The values of one axis: a non-empty list of ascending unique integers in [0, MAX_AXIS_VALUE]."""
    if not isinstance(values, (list, tuple)):
        return [problem(key, f"expected a list of integers such as [0, 1, 2, 4]; got {values!r}")]
    if not values:
        return [problem(key, "is empty; give at least one value, e.g. [0, 1, 2, 4], or drop the axis")]
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            return [problem(key, f"[{i}] must be an integer; got {value!r} ({type(value).__name__})")]
        if not 0 <= value <= MAX_AXIS_VALUE:
            return [problem(key, f"[{i}] is {value}; axis values lie in [0, {MAX_AXIS_VALUE}]")]
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            pair = f"[{i - 1}]={values[i - 1]}, [{i}]={values[i]}"
            return [
                problem(key, f"must be ascending and unique; got {list(values)} ({pair}): write {sorted(set(values))}")
            ]
    return []


def combination_problems(axes: Mapping, combinations: tuple) -> list[ConfigProblem]:
    """Every problem of `capture.axis_combinations` (keys `capture.axis_combinations[i]`): each entry gives every
    axis of `capture.axes` one of its captured values, and no entry repeats another."""
    key = "capture.axis_combinations"
    if not combinations:
        return []
    if not axes:
        return [problem(key, "lists combinations but capture.axes names no axis: add the axes or drop the list")]
    out: list[ConfigProblem] = []
    seen: dict[tuple[tuple[str, int], ...], int] = {}
    names = ", ".join(axes)
    for i, entry in enumerate(combinations):
        where = f"{key}[{i}]"
        unknown = [name for name in entry if name not in axes]
        missing = [name for name in axes if name not in entry]
        if unknown or missing:
            what = f"names {unknown[0]!r}, not an axis" if unknown else f"gives no value for {missing[0]}"
            out.append(problem(where, f"{what}: every entry gives each axis of capture.axes ({names}) one value"))
            continue
        wrong = [(n, v) for n, v in entry.items() if isinstance(v, bool) or not isinstance(v, int) or v not in axes[n]]
        if wrong:
            name, value = wrong[0]
            captured = list(axes[name])
            out.append(problem(where, f"{name} {value!r} is not a value of capture.axes.{name} {captured}"))
            continue
        values = tuple(entry[name] for name in axes)
        if values in seen:
            out.append(problem(where, f"repeats {key}[{seen[values]}]; drop one"))
        seen.setdefault(values, i)
    return out
