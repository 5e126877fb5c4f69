"""Reading a traffic histogram file for `graphcap sizes`: `TOKENS [COUNT] [AXIS=VALUE ...]` lines, every problem
one line naming file:line, the value and the fix.

An `AXIS=VALUE` field gives the step's value of a key axis of the config (`capture.axes`): a name the
config plans, a whole number >= 0, each axis at most once per line; an axis a line does not state is at
its smallest planned value (as a step that states none). A value above the axis's largest is traffic
that runs eagerly (`above_max_axis.NAME`), not an error.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from graphcap.cli._common import UserError

if TYPE_CHECKING:  # `graphcap --help` imports this module: the sizing rooms load when a histogram is read
    from graphcap.sizing.axes import AxisPlan, Step

__all__ = ["MAX_HISTOGRAM_BYTES", "read_histogram", "read_steps"]

MAX_HISTOGRAM_BYTES = 64 << 20
"""Largest histogram read (64 MiB: ten million one-per-line observations)."""
_MAX_LINE = 4096


def read_histogram(path: str, plan: AxisPlan | None = None) -> dict[int, float]:
    """`read_steps` -> {tokens: weight}, whatever the steps' axis values."""
    counts: dict[int, float] = {}
    for (n, _), w in read_steps(path, plan).items():
        counts[n] = counts.get(n, 0.0) + w
    return counts


def read_steps(path: str, plan: AxisPlan | None = None) -> dict[Step, float]:
    """`TOKENS [COUNT] [AXIS=VALUE ...]` lines -> {(tokens, axis values): weight}, axis values as `plan.step`
    gives them (no plan: no axes); every problem is a `UserError` naming file and line."""
    from graphcap.sizing.axes import AxisPlan

    plan = plan or AxisPlan()
    counts: dict[Step, float] = {}
    try:
        with open(path, "rb") as handle:
            read = 0
            for number, raw in enumerate(iter(lambda: handle.readline(_MAX_LINE + 1), b""), 1):
                read += len(raw)
                if len(raw) > _MAX_LINE:
                    raise UserError(f"{path}:{number}: line longer than {_MAX_LINE} bytes; is it a histogram?")
                if read > MAX_HISTOGRAM_BYTES:
                    raise UserError(
                        f"{path}: larger than {MAX_HISTOGRAM_BYTES >> 20} MiB; aggregate it as TOKENS COUNT"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                        "expected TOKENS or TOKENS COUNT"
                    ) from None
                _add_line(counts, line, path, number, plan)
    except OSError as exc:
        raise UserError(f"--histogram {path}: cannot read: {exc.strerror or exc}") from None
    total = sum(counts.values())
    if not counts or total <= 0:
        raise UserError(f"{path}: no batch sizes in the histogram")
    if not math.isfinite(total):
        raise UserError(f"{path}: the counts sum to {total}; scale them down (they are relative weights)")
    return counts


_AXIS_FIELD = re.compile(r"([^=]*)=(.*)")


def _add_line(counts: dict[Step, float], line: str, path: str, number: int, plan: AxisPlan) -> None:
    text = line.split("#", 1)[0].replace(",", " ").split()
    if not text:
        return
    where = f"{path}:{number}"
    first_axis = next((i for i, field in enumerate(text) if "=" in field), len(text))
    axes = _axis_fields(text[first_axis:], where, plan)
    text = text[:first_axis]
    if not text:
        raise UserError(f"{where}: expected TOKENS [COUNT] before the axis values; got {line.strip()!r}")
    try:
        values = [float(v) for v in text]
    except ValueError:
        raise UserError(f"{where}: expected TOKENS or TOKENS COUNT; got {line.strip()!r}") from None
    if (
        len(values) > 2
        or not all(map(math.isfinite, values))  # int(inf) and int(nan) raise
        or values[0] != int(values[0])
        or values[0] < 1
        or (len(values) == 2 and values[1] < 0)
    ):
        raise UserError(
            f"{path}:{number}: expected a token count >= 1 and an optional count >= 0; got {line.strip()!r}"
        )
    step = plan.step(int(values[0]), axes)
    counts[step] = counts.get(step, 0.0) + (values[1] if len(values) == 2 else 1.0)


def _axis_fields(fields: list[str], where: str, plan: AxisPlan) -> dict[str, int]:
    """`AXIS=VALUE` fields -> {axis: value}; a `UserError` naming the field and the fix for anything else."""
    axes: dict[str, int] = {}
    planned = ", ".join(plan.values) or "none"
    for field in fields:
        match = _AXIS_FIELD.fullmatch(field)
        name, value = match.groups() if match else ("", field)
        if match is None or not name:
            raise UserError(
                f"{where}: {field!r}: after TOKENS [COUNT] a line holds AXIS=VALUE fields only, e.g. lora=3"
            )
        if name not in plan.values:
            fix = f"name one of them or drop {field}" if plan.values else f"drop {field} or add {name} to capture.axes"
            raise UserError(f"{where}: {field}: {name!r} is not an axis of capture.axes (its axes: {planned}); {fix}")
        if not value.isascii() or not value.isdigit():
            raise UserError(f"{where}: {field}: an axis value is a whole number >= 0, e.g. {name}=3")
        if name in axes:
            raise UserError(f"{where}: {field}: {name} is given twice ({name}={axes[name]} first); give it once")
        axes[name] = int(value)
    return axes
