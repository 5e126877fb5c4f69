"""Sizes chosen from traffic, scored on traffic they were not chosen from.

`choose_sizes` is exact on the histogram it is given, so its waste there is optimistic: a size
placed at a count seen a few times is wasted on a new sample where that count is not seen, and
a count seen only in the new sample pads to the next size up. `choose_held_out` scores two ways
of choosing on steps they were not chosen from, and keeps the better:

- `traffic`: `choose_sizes` on the histogram as it is;
- `ladder`: the same choice with sizes restricted to the default ladder (`default_capture_sizes`
  of the largest allowed size): every count is counted at the ladder size it pads to, so sizes
  sit where the ladder puts them, and at `max_graphs` >= the ladder's length the choice is the
  ladder itself.

The histogram's steps are split in two halves (`split_steps`: each step to either half with even
odds, seeded, so a count seen once lands in one half only and a common one splits unevenly, as two
samples of the same traffic differ); each way chooses on one half and is scored on the other, both ways round.
The way with the lower held-out waste is then chosen on the whole histogram. So the held-out
waste of the choice is never above the ladder's at the same number of graphs, on this split.
A step of the scoring half above every size chosen on the other half runs eagerly (not padding).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, TypeVar

from graphcap.sizing.choice import GraphCosts, SizeChoice, SizeConstraints, choose_sizes
from graphcap.sizing.sizes import default_capture_sizes

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

__all__ = [
    "HeldOutChoice",
    "choose_held_out",
    "choose_on_halves",
    "choose_way",
    "held_out_waste",
    "ladder_sizes",
    "split_steps",
]

K = TypeVar("K", bound="SupportsRichComparison")
WAYS = ("traffic", "ladder")
_EXACT_DRAWS = 4096  # steps of one count drawn one by one; above, the normal limit of their binomial


@dataclass(frozen=True, slots=True)
class HeldOutChoice:
    """The choice kept (`choice`, on the whole histogram), the way it was chosen, and the scores.

    `held_out[way]`: the waste of that way chosen on one half and scored on the other (the mean
    of both directions); None when the histogram's counts are not whole steps (no split).
    """

    choice: SizeChoice
    way: str
    held_out: dict[str, float] | None

    @property
    def in_sample(self) -> float:
        """The waste of the choice on the histogram it was chosen from."""
        return self.choice.waste


def split_steps(histogram: Mapping[K, float], seed: int = 0) -> tuple[dict[K, float], dict[K, float]] | None:
    """Two halves of the steps, each step to either half with even odds (a seeded draw: the same halves
    every run), as two samples of the same traffic would see them; None when a count is not a whole
    number of steps (relative weights cannot be split into steps) or a half would be empty. Keys are
    token counts, or any sortable steps (`(tokens, axis values)`: without axes, the same draws)."""
    rng = random.Random(seed)
    halves: tuple[dict[K, float], dict[K, float]] = ({}, {})
    for n in sorted(histogram):
        steps = histogram[n]
        if steps != int(steps):
            return None
        steps = int(steps)
        if steps <= _EXACT_DRAWS:
            first = sum(rng.random() < 0.5 for _ in range(steps))
        else:  # the binomial's normal limit: as exact as the draw needs, in O(1)
            first = min(steps, max(0, round(rng.gauss(steps / 2, math.sqrt(steps) / 2))))
        for half, share in ((0, first), (1, steps - first)):
            if share:
                halves[half][n] = float(share)
    return halves if halves[0] and halves[1] else None


def held_out_waste(sizes: tuple[int, ...], histogram: Mapping[int, float], constraints: SizeConstraints) -> float:
    """Padded tokens over replayed tokens of `sizes` on `histogram` (steps above every size, or that
    `constraints` send eagerly, are not replayed)."""
    real = padded = 0.0
    for n, steps in histogram.items():
        if n > sizes[-1] or (constraints.uniform_only and n % constraints.multiple_of):
            continue
        size = next(s for s in sizes if s >= n)
        real += n * steps
        padded += size * steps
    return 0.0 if padded == 0 else (padded - real) / padded


class Budget(TypedDict):
    """`choose_sizes`'s memory arguments, passed on by keyword."""

    costs: GraphCosts | None
    memory_budget: int | None


def choose_held_out(
    histogram: Mapping[int, float],
    max_graphs: int,
    constraints: SizeConstraints,
    *,
    costs: GraphCosts | None = None,
    memory_budget: int | None = None,
) -> HeldOutChoice:
    """`choose_sizes` by the way (`WAYS`) whose held-out waste is lower; see the module docstring.

    With a memory budget, or a histogram that cannot be split into steps, only `traffic` is
    tried (the ladder's sizes are not priced by `costs`); `held_out` then scores it alone, or is None.
    """
    halves = split_steps(histogram)
    return choose_on_halves(histogram, halves, max_graphs, constraints, costs=costs, memory_budget=memory_budget)


def choose_on_halves(
    histogram: Mapping[int, float],
    halves: tuple[Mapping[int, float], Mapping[int, float]] | None,
    max_graphs: int,
    constraints: SizeConstraints,
    *,
    costs: GraphCosts | None = None,
    memory_budget: int | None = None,
) -> HeldOutChoice:
    """`choose_held_out` on halves split by the caller (None: not split, `traffic` unscored): the halves of
    steps that carry more than a token count (key axes, `graphcap.sizing.axes`), each as its token counts."""
    ways = ("traffic",) if memory_budget is not None else WAYS
    kwargs: Budget = {"costs": costs, "memory_budget": memory_budget}
    held_out: dict[str, float] | None = None
    if halves is not None:
        held_out = {}
        for way in ways:
            scores = []
            for chosen_on, scored_on in (halves, halves[::-1]):
                try:
                    sizes = choose_way(way, chosen_on, max_graphs, constraints, kwargs).sizes
                except ValueError:  # a half with no replayable step: the other direction decides
                    continue
                scores.append(held_out_waste(sizes, scored_on, constraints))
            if scores:
                held_out[way] = sum(scores) / len(scores)
    way = "traffic" if not held_out else min(held_out, key=lambda w: (held_out[w], WAYS.index(w)))
    return HeldOutChoice(choose_way(way, histogram, max_graphs, constraints, kwargs), way, held_out or None)


def choose_way(
    way: str, histogram: Mapping[int, float], max_graphs: int, constraints: SizeConstraints, kwargs: Budget
) -> SizeChoice:
    """The sizes `way` (of `WAYS`) chooses on `histogram`; `kwargs`: `costs` and `memory_budget` (`choose_sizes`'s)."""
    if way == "traffic":
        return choose_sizes(histogram, max_graphs, constraints, **kwargs)
    ladder = ladder_sizes(constraints)
    on_ladder: dict[int, float] = {}
    for n, steps in histogram.items():
        top = next((s for s in ladder if s >= n), n)  # above the ladder: eager either way, kept as is
        on_ladder[top] = on_ladder.get(top, 0.0) + steps
    sizes = choose_sizes(on_ladder, max_graphs, constraints).sizes
    # The same sizes, described on the real histogram (its buckets, waste and eager steps).
    real = choose_sizes(histogram, 1, constraints)
    costs = kwargs["costs"]
    priced = costs is not None and all(s in costs.per_size and s in costs.shared for s in sizes)
    graph_bytes = costs.bytes_of(sizes) if costs is not None and priced else None
    return SizeChoice(sizes, real.histogram, constraints, real.eager, graph_bytes)


def ladder_sizes(constraints: SizeConstraints) -> list[int]:
    """The default ladder within `constraints` (what the `ladder` way restricts sizes to; price them too)."""
    return default_capture_sizes(constraints.largest, constraints.multiple_of)
