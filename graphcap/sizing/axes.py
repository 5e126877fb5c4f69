"""Sizes chosen for traffic with key axes (`capture.axes`): graphs counted per combination, waste per axis value.

A step of traffic is `(tokens, axes)`, `axes` its value of every axis in the config's order (`AxisPlan.step`:
an axis it does not state at its smallest value, as `StepBatch` without it). One schedule of sizes serves
every planned combination of axis values, so a schedule of `k` sizes captures `k * num_combinations`
graphs: `choose_with_axes(steps, max_graphs, ...)` chooses at most `max_graphs // num_combinations` sizes.

Each step goes where `KeyRegistry.dispatch` sends it (`AxisChoice.place`): above the largest size it runs
eagerly (`above_max_size`, or `over_budget` where a memory budget kept the sizes below it); an axis value
above the axis's largest runs eagerly (`above_max_axis.NAME`), as does one no planned combination holds
(`no_axis_combination`), and under `full_decode_only` a count that is not whole requests (`decode_only`);
else its axis values pad to the planned combination that holds them (`KeyAxes`)
and its tokens to the smallest size that holds them. The sizes are chosen (`choose_on_halves`) on the token
counts of the steps whose axis values replay: the others run eagerly whatever the sizes.

Per planned axis value (`AxisValueWaste`): the steps that replay a graph at that value, the share of their
tokens that is padding, and the share of their axis slots that is padding (a step of `lora=3` replays the
`lora=4` graph: one of its four slots is padded). In sample, and held out on the halves of the steps
(`split_steps`) that `choose_held_out` scores: chosen on one half by the way kept, scored on the other.

`choose_axis_values` chooses an axis's values from the steps as `choose_sizes` chooses sizes (padded slots
are its padded tokens), no more of them than the plan has: the sizes and the values are chosen each on its
own (padded tokens and padded slots are different costs), the values first, then the sizes for the graphs
their combinations leave (`graphcap sizes --choose-axes`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphcap.keys.axes import KeyAxes
from graphcap.sizing.choice import GraphCosts, SizeConstraints, choose_sizes
from graphcap.sizing.held_out import Budget, HeldOutChoice, choose_on_halves, choose_way, split_steps

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig

__all__ = [
    "AxisChoice",
    "AxisPlan",
    "AxisValueWaste",
    "Step",
    "axis_values_held_out",
    "choose_axis_values",
    "choose_with_axes",
    "slot_waste",
    "value_waste",
]

Step = tuple[int, tuple[tuple[str, int], ...]]
"""A step of traffic: its token count and its value of every axis, `(name, value)` in the config's order."""


class AxisPlan:
    """The planned axis values and combinations (`capture.axes`, `capture.axis_combinations`), read as dispatch
    reads them (`KeyAxes`). Without axes: one combination, `()`."""

    def __init__(self, axes: Mapping[str, Iterable[int]] | None = None, combinations: Iterable[Mapping] = ()):
        self.key_axes = KeyAxes(axes, combinations)
        self.values: dict[str, tuple[int, ...]] = self.key_axes.values
        """Each axis's planned values, ascending."""
        self.combinations: list[tuple[tuple[str, int], ...]] = self.key_axes.planned
        """The planned combinations (`GraphKey.axes` of each), every one captured at every size."""

    @classmethod
    def from_config(cls, config: CaptureConfig) -> AxisPlan:
        return cls(config.capture.axes, config.capture.axis_combinations)

    @property
    def num_combinations(self) -> int:
        """Graphs per size: the planned combinations (1 without axes)."""
        return len(self.combinations)

    def step(self, tokens: int, axes: Mapping[str, int] | None = None) -> Step:
        """The step of `tokens` stating `axes` (a missing axis at its smallest value); `ValueError` for an axis
        the plan does not name, or a value that is not an integer >= 0."""
        for name, value in (axes or {}).items():
            if name not in self.values:
                planned = ", ".join(self.values) or "none"
                raise ValueError(f"axis {name!r} is not in capture.axes (its axes: {planned})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"axis {name} value must be an integer >= 0; got {value!r}")
        return tokens, tuple((name, (axes or {}).get(name, floor)) for name, floor in self.key_axes.defaults)

    def place(self, axes: tuple[tuple[str, int], ...]) -> tuple[tuple[tuple[str, int], ...] | None, str]:
        """`(the planned combination a step of these axis values replays, "")`, or `(None, eager reason)`."""
        padded = []
        for (name, value), table in zip(axes, self.key_axes.tables, strict=True):
            if value >= len(table):
                return None, f"above_max_axis.{name}"
            padded.append(table[value])
        held = self.key_axes.holder.get(tuple(padded))
        return (held, "") if held is not None else (None, "no_axis_combination")


@dataclass(frozen=True, slots=True)
class AxisValueWaste:
    """The steps that replay a graph at `axis` = `value`, and their waste.

    `share`: their fraction of every step; `token_waste`: padded tokens over their replayed tokens;
    `slot_waste`: padded slots (the graph's value minus the step's) over the graph's slots, None where
    the value is 0 (no slots). Wastes are None where no step replays at the value.
    """

    axis: str
    value: int
    share: float
    token_waste: float | None
    slot_waste: float | None


def value_waste(
    steps: Mapping[Step, float], sizes: tuple[int, ...], plan: AxisPlan, constraints: SizeConstraints
) -> list[AxisValueWaste]:
    """`AxisValueWaste` of every planned axis value (config order, ascending values) for `steps` replayed with
    `sizes` (a step placed as `AxisChoice.place` places it; eager steps count in no row's waste)."""
    sums = {(name, v): [0.0, 0.0, 0.0, 0.0, 0.0] for name, values in plan.values.items() for v in values}
    total = sum(steps.values())
    for (n, axes), w in steps.items():
        if n > sizes[-1] or (constraints.uniform_only and n % constraints.multiple_of):
            continue
        held, _ = plan.place(axes)
        if held is None:
            continue
        size = next(s for s in sizes if s >= n)
        for (name, own), (_, value) in zip(axes, held, strict=True):
            row = sums[name, value]
            row[0] += w
            row[1] += n * w
            row[2] += size * w
            row[3] += own * w
            row[4] += value * w
    return [
        AxisValueWaste(
            name,
            value,
            steps_at / total,
            (padded - real) / padded if steps_at else None,
            (slots - used) / slots if steps_at and slots else None,
        )
        for (name, value), (steps_at, real, padded, used, slots) in sums.items()
    ]


@dataclass(frozen=True, slots=True)
class AxisChoice:
    """Sizes chosen for traffic with key axes, and where every step of it goes.

    `held`: the sizes (`held.choice`, on the token counts of the steps whose axis values replay), chosen
    as `choose_held_out` chooses; `steps`: the traffic; `held_out_values`: `value_waste` held out (the
    mean of both directions, per row), None when the steps cannot be split.
    """

    held: HeldOutChoice
    plan: AxisPlan
    steps: dict[Step, float]
    memory_budget: int | None = None
    held_out_values: list[AxisValueWaste] | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.held.choice.sizes

    @property
    def num_graphs(self) -> int:
        """Graphs the schedule captures, as `--max-graphs` counts them: sizes x planned combinations."""
        return len(self.sizes) * self.plan.num_combinations

    def place(self, step: Step) -> tuple[tuple[int, tuple[tuple[str, int], ...]] | None, str]:
        """`((size, combination), "")` of the graph `step` replays, or `(None, eager reason)` in dispatch's order."""
        n, axes = step
        constraints = self.held.choice.constraints
        if n > self.sizes[-1]:
            q = constraints.multiple_of
            budget = self.memory_budget is not None and -(-n // q) * q <= constraints.largest
            return None, "over_budget" if budget else "above_max_size"
        held, reason = self.plan.place(axes)
        if held is None:
            return None, reason
        if constraints.uniform_only and n % constraints.multiple_of:
            return None, "decode_only"
        return (next(s for s in self.sizes if s >= n), held), ""

    def eager_reasons(self) -> dict[str, dict[Step, float]]:
        """The steps that run eagerly, by reason (`place`), each reason's steps in ascending order."""
        out: dict[str, dict[Step, float]] = {}
        for step, w in sorted(self.steps.items()):
            _, reason = self.place(step)
            if reason:
                out.setdefault(reason, {})[step] = w
        return out

    @property
    def eager_share(self) -> float:
        """Fraction of the steps that run eagerly."""
        return sum(sum(r.values()) for r in self.eager_reasons().values()) / sum(self.steps.values())

    def values(self) -> list[AxisValueWaste]:
        """`value_waste` in sample: on the steps the sizes were chosen from."""
        return value_waste(self.steps, self.sizes, self.plan, self.held.choice.constraints)


def choose_with_axes(
    steps: Mapping[Step, float],
    max_graphs: int,
    constraints: SizeConstraints,
    plan: AxisPlan,
    *,
    costs: GraphCosts | None = None,
    memory_budget: int | None = None,
) -> AxisChoice:
    """Sizes for `steps` (`Step` -> how many ran) whose graphs, one per size and planned combination, number
    at most `max_graphs`; see the module docstring. `costs` (`graphcap.memory.graph_costs.graph_costs`) price
    a size at every combination. Without axes (`AxisPlan()`, steps `(tokens, ())`) the choice and its
    held-out scores are `choose_held_out`'s on the token counts. `ValueError` for a bad argument, `max_graphs`
    below the combinations, or traffic of which no step can replay."""
    combos = plan.num_combinations
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(f"max_graphs must be an integer >= 1; got {max_graphs!r}")
    if max_graphs < combos:
        raise ValueError(
            f"max_graphs {max_graphs} is below the {combos} planned combinations of key axes: every size is "
            f"captured at each, so give at least {combos} (a multiple of {combos} uses every graph)"
        )
    checked = _checked(steps, plan)
    halves = split_steps(checked)
    marginal = _replayed_tokens(checked, plan)
    if not marginal:
        raise ValueError(
            "no observed step can replay: every step's axis values are above the largest planned value or "
            "held by no planned combination; add those values to capture.axes (or capture.axis_combinations)"
        )
    token_halves = None
    if halves is not None:
        token_halves = (_replayed_tokens(halves[0], plan), _replayed_tokens(halves[1], plan))
    kwargs: Budget = {"costs": costs, "memory_budget": memory_budget}
    held = choose_on_halves(marginal, token_halves, max_graphs // combos, constraints, **kwargs)
    held_out_values = None
    if halves is not None and token_halves is not None and held.held_out is not None:
        scored = []
        for tokens, scored_on in zip(token_halves, halves[::-1], strict=True):
            try:
                sizes = choose_way(held.way, tokens, max_graphs // combos, constraints, kwargs).sizes
            except ValueError:  # a half with no replayable step: the other direction decides
                continue
            scored.append(value_waste(scored_on, sizes, plan, constraints))
        if scored:
            held_out_values = [_mean(rows) for rows in zip(*scored, strict=True)]
    return AxisChoice(held, plan, checked, memory_budget, held_out_values)


def _checked(steps: Mapping[Step, float], plan: AxisPlan) -> dict[Step, float]:
    if not isinstance(steps, Mapping):
        raise ValueError(f"steps must map (tokens, axis values) to step counts; got {type(steps).__name__}")
    out: dict[Step, float] = {}
    names = tuple(plan.values)
    for step, w in steps.items():
        if not isinstance(step, tuple) or len(step) != 2 or not isinstance(step[1], tuple):
            raise ValueError(f"a step is (tokens, ((axis, value), ...)), as AxisPlan.step makes it; got {step!r}")
        n, axes = step
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"step token count must be an integer >= 1; got {n!r}")
        if tuple(name for name, _ in axes) != names or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for _, v in axes
        ):
            raise ValueError(f"step {step!r} must give every axis of {names} an integer >= 0 (AxisPlan.step)")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise ValueError(f"count of step {step!r} must be a finite number >= 0; got {w!r}")
        if w > 0:
            out[step] = float(w)
    if not out:
        raise ValueError("steps hold no step (every count is 0)")
    if not math.isfinite(sum(out.values())):
        raise ValueError("step counts sum to infinity; scale them down (they are relative weights)")
    return out


def _replayed_tokens(steps: Mapping[Step, float], plan: AxisPlan) -> dict[int, float]:
    """The token counts of the steps whose axis values some planned combination holds."""
    out: dict[int, float] = {}
    for (n, axes), w in sorted(steps.items()):
        if plan.place(axes)[0] is not None:
            out[n] = out.get(n, 0.0) + w
    return out


def _mean(rows: tuple[AxisValueWaste, ...]) -> AxisValueWaste:
    """One row, each number the mean of the rows' (a waste over the rows that have one)."""

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    first = rows[0]
    share = sum(r.share for r in rows) / len(rows)
    tokens, slots = mean([r.token_waste for r in rows]), mean([r.slot_waste for r in rows])
    return AxisValueWaste(first.axis, first.value, share, tokens, slots)


def choose_axis_values(steps: Mapping[Step, float], plan: AxisPlan) -> dict[str, tuple[int, ...]]:
    """Per axis, at most as many values as `plan` has, within its largest, that pad the fewest axis slots over
    `steps` (`choose_sizes`'s exact optimum on the axis's values, each shifted up by one: a padded slot is a
    padded token). The largest observed value within the plan's largest always gets one, so the combinations,
    and with them the graphs per size, are never more than `plan`'s; values above it stay eager.
    `ValueError` when an axis has no observed value within its largest, or `plan` lists combinations."""
    if plan.num_combinations != len(list(itertools.product(*plan.values.values()))):
        raise ValueError(
            "capture.axis_combinations lists combinations by value, so the values cannot be chosen anew: "
            "drop the list to choose them"
        )
    out: dict[str, tuple[int, ...]] = {}
    checked = _checked(steps, plan)
    for i, (name, values) in enumerate(plan.values.items()):
        seen: dict[int, float] = {}
        for (_, axes), w in checked.items():
            if axes[i][1] <= values[-1]:
                seen[axes[i][1] + 1] = seen.get(axes[i][1] + 1, 0.0) + w
        if not seen:
            raise ValueError(
                f"no observed step has a {name} value within capture.axes.{name}'s largest {values[-1]}: "
                f"there is no {name} value to choose; raise the largest value"
            )
        chosen = choose_sizes(seen, len(values), SizeConstraints(values[-1] + 1)).sizes
        out[name] = tuple(x - 1 for x in chosen)
    return out


def slot_waste(steps: Mapping[Step, float], values: Mapping[str, tuple[int, ...]]) -> dict[str, float]:
    """Per axis, padded slots over the slots of the graphs `steps` replay, each axis on its own (a step above
    an axis's largest value runs eagerly and counts in none; with listed combinations see `value_waste`)."""
    out = {}
    for i, (name, planned) in enumerate(values.items()):
        used = slots = 0.0
        for (_, axes), w in steps.items():
            value = axes[i][1]
            if value <= planned[-1]:
                used += value * w
                slots += next(v for v in planned if v >= value) * w
        out[name] = (slots - used) / slots if slots else 0.0
    return out


def axis_values_held_out(steps: Mapping[Step, float], plan: AxisPlan) -> dict[str, float] | None:
    """Per axis, the `slot_waste` of `choose_axis_values` chosen on one half of the steps (`split_steps`) and
    scored on the other, the mean of both directions; None when the steps cannot be split."""
    halves = split_steps(_checked(steps, plan))
    if halves is None:
        return None
    scores: dict[str, list[float]] = {name: [] for name in plan.values}
    for chosen_on, scored_on in (halves, halves[::-1]):
        try:
            values = choose_axis_values(chosen_on, plan)
        except ValueError:  # a half with no value within an axis's largest: the other direction decides
            continue
        for name, waste in slot_waste(scored_on, values).items():
            scores[name].append(waste)
    if not all(scores.values()):
        return None
    return {name: sum(w) / len(w) for name, w in scores.items()}
