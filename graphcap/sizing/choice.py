"""Capture sizes chosen from observed traffic: the fewest padded tokens for a number of graphs.

`choose_sizes(histogram, max_graphs, constraints)` takes how many steps ran at each token count
and returns the capture sizes that minimise the expected padded tokens per step, with at most
`max_graphs` sizes. It is exact: an optimal schedule only needs sizes at observed token counts
(a size between two of them pads more than the lower one and holds nothing more), so a dynamic
program over the `m` distinct counts finds the optimum, in O(max_graphs * m) with a convex hull
of the bucket costs. The largest replayable count always gets a size; a step above every
allowed size runs eagerly, and the choice says which do.

With a memory budget (`GraphCosts` from graphcap's own estimate, `graphcap.memory.graph_costs`), the largest
size is the largest whose graphs fit, and the rest of the budget is spent on the sizes that save
the most padding: exact where graphs share one pool sized by the largest key (the CUDA backend:
smaller graphs cost no more), a Lagrangian search along the padding/bytes trade-off where every
size keeps memory of its own (the emulated backend: always within the budget, the padding
minimal among the schedules on that trade-off's convex hull).

A plain function of its arguments, so a manager can call it online from its own counts. A leaf
module: it imports nothing of graphcap (nor torch or numpy).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig

__all__ = ["GraphCosts", "SizeChoice", "SizeConstraints", "candidate_sizes", "choose_sizes"]


@dataclass(frozen=True, slots=True)
class SizeConstraints:
    """What a schedule may contain, from the config (`SizeConstraints.from_config`)."""

    max_size: int
    """Largest size allowed (`capture.max_size`); a step above it runs eagerly."""
    multiple_of: int = 1
    """Every size is a multiple of this: `capture.uniform_query_len` when the mode captures uniform
    keys, so a uniform step pads to whole requests (as `default_capture_sizes` does)."""
    uniform_only: bool = False
    """Only uniform steps replay (`full_decode_only`): a token count that is not whole requests
    of `multiple_of` tokens runs eagerly whatever the sizes."""

    def __post_init__(self) -> None:
        for name in ("max_size", "multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SizeConstraints.{name} must be an integer >= 1; got {value!r}")
        if self.max_size < self.multiple_of:
            raise ValueError(
                f"SizeConstraints.max_size {self.max_size} holds no multiple of {self.multiple_of}; "
                f"raise max_size to at least {self.multiple_of}"
            )

    @property
    def largest(self) -> int:
        """The largest size allowed: `max_size` rounded down to a multiple of `multiple_of`."""
        return self.max_size - self.max_size % self.multiple_of

    @classmethod
    def from_config(cls, config: CaptureConfig) -> SizeConstraints:
        """The config's bounds: `capture.max_size`, whole uniform requests when the mode captures
        uniform keys, and under `full_decode_only` at most `batching.max_num_seqs` requests."""
        cap = config.capture
        q = cap.uniform_query_len
        if cap.mode == "none":
            raise ValueError("capture.mode is none: no graph is captured, so there are no sizes to choose")
        top = config.capture_sizes.max_size  # = capture.max_size, resolved
        if cap.mode == "full_decode_only":
            top = min(top, config.batching.max_num_seqs * q)
        return cls(top, q if cap.mode != "piecewise" else 1, cap.mode == "full_decode_only")


@dataclass(frozen=True, slots=True)
class GraphCosts:
    """Graph memory of a schedule, split the way graphcap's estimate adds it up.

    `per_size[s]`: bytes the graphs of size `s` keep on their own (summed over the sizes);
    `shared[s]`: bytes that depend only on the largest size `s` (a pool shared by every graph,
    the keys every schedule reaching `s` gets). A schedule's bytes: `bytes_of(sizes)`.
    """

    per_size: Mapping[int, int]
    shared: Mapping[int, int]
    backend: str = ""
    """What the bytes are (e.g. `cuda`, `emulated`), for messages."""

    def bytes_of(self, sizes: Iterable[int]) -> int:
        sizes = list(sizes)
        return sum(self.per_size[s] for s in sizes) + self.shared[max(sizes)]


@dataclass(frozen=True, slots=True)
class SizeChoice:
    """The chosen schedule and what it costs on the histogram it was chosen for.

    `histogram` holds the steps (relative weights) by token count, `eager` the counts no size
    replays (`eager_reasons` says why); `memory` is the graphs' bytes by the `GraphCosts`
    given, else None.
    """

    sizes: tuple[int, ...]
    histogram: dict[int, float]
    constraints: SizeConstraints
    eager: dict[int, float] = field(default_factory=dict)
    memory: int | None = None

    def pad(self, num_tokens: int) -> int | None:
        """The size a step of `num_tokens` (>= 1) replays at; None when it runs eagerly."""
        if num_tokens > self.sizes[-1] or self._not_uniform(num_tokens):
            return None
        return next(s for s in self.sizes if s >= num_tokens)

    def eager_reasons(self) -> dict[str, dict[int, float]]:
        """The eager counts by reason, named as the manager counts eager steps: `above_max_size`
        (no allowed size holds them), `over_budget` (the memory budget kept the largest size
        below them), `decode_only` (`uniform_only` and not whole requests)."""
        out: dict[str, dict[int, float]] = {}
        for n, w in sorted(self.eager.items()):
            if self._not_uniform(n):
                reason = "decode_only"
            elif _round_up(n, self.constraints.multiple_of) > self.constraints.largest:
                reason = "above_max_size"
            else:
                reason = "over_budget"
            out.setdefault(reason, {})[n] = w
        return out

    def _not_uniform(self, num_tokens: int) -> bool:
        return self.constraints.uniform_only and num_tokens % self.constraints.multiple_of != 0

    def buckets(self) -> list[tuple[int, int, float, float, float]]:
        """Per size: `(size, first token count it holds, steps, real tokens, padded tokens)`."""
        rows, first = [], 1
        for size in self.sizes:
            held = [(n, w) for n, w in self.histogram.items() if first <= n <= size and n not in self.eager]
            steps = sum(w for _, w in held)
            rows.append((size, first, steps, sum(n * w for n, w in held), size * steps))
            first = size + 1
        return rows

    @property
    def waste(self) -> float:
        """Fraction of replayed tokens that are padding (steps that run eagerly waste none)."""
        rows = self.buckets()
        padded = sum(r[4] for r in rows)
        return 0.0 if padded == 0 else (padded - sum(r[3] for r in rows)) / padded

    @property
    def eager_share(self) -> float:
        """Fraction of the steps that run eagerly."""
        return sum(self.eager.values()) / sum(self.histogram.values())


def candidate_sizes(histogram: Mapping[int, float], constraints: SizeConstraints) -> tuple[int, ...]:
    """The sizes an optimal schedule may use: every replayable observed count, rounded up to a
    multiple of `constraints.multiple_of`, ascending (what `graphcap.memory.graph_costs.graph_costs` must price)."""
    return tuple(sorted(_points(_checked(histogram), constraints)[0]))


def choose_sizes(
    histogram: Mapping[int, float],
    max_graphs: int,
    constraints: SizeConstraints,
    *,
    costs: GraphCosts | None = None,
    memory_budget: int | None = None,
) -> SizeChoice:
    """The sizes (at most `max_graphs`) that minimise expected padded tokens over `histogram`.

    `histogram` maps a token count (>= 1) to how many steps ran at it (>= 0, any finite scale).
    The largest count a size may hold always gets one; counts above `constraints.largest` run
    eagerly (listed in `.eager`). With `memory_budget` (bytes) and `costs`, the graphs' bytes
    `costs.bytes_of(sizes)` stay within the budget: the largest size is the largest that fits
    on its own, and the counts above it run eagerly. Raises `ValueError` for a bad argument, for
    a histogram with no replayable step, and for a budget below the smallest graph.
    """
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(f"max_graphs must be an integer >= 1; got {max_graphs!r}")
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
            raise ValueError(f"memory_budget must be bytes >= 1; got {memory_budget!r}")
        if costs is None:
            raise ValueError("memory_budget needs the graphs' costs (graphcap.memory.graph_costs.graph_costs)")
    weights = _checked(histogram)
    points, eager = _points(weights, constraints)
    if not points:
        smallest = min(weights)
        raise ValueError(
            f"no observed step can replay: the smallest token count {smallest} is above the largest "
            f"allowed size {constraints.largest}"
            + (" or is not whole uniform requests" if constraints.uniform_only else "")
            + "; raise capture.max_size (and batching.max_num_tokens)"
        )
    xs = sorted(points)
    if costs is not None:
        missing = [x for x in xs if x not in costs.per_size or x not in costs.shared]
        if missing:
            raise ValueError(f"costs do not price size {missing[0]}; build them from candidate_sizes(...)")
    if memory_budget is not None and costs is not None:  # costs is not None with a budget (checked above)
        fits = [x for x in xs if costs.per_size[x] + costs.shared[x] <= memory_budget]
        if not fits:
            raise ValueError(
                f"memory budget {memory_budget} bytes is below the smallest graph's "
                f"{costs.per_size[xs[0]] + costs.shared[xs[0]]} bytes (size {xs[0]}, {costs.backend} estimate); "
                "raise the budget"
            )
        if fits[-1] < xs[-1]:
            for n, w in weights.items():
                if n not in eager and _round_up(n, constraints.multiple_of) > fits[-1]:
                    eager[n] = w
            xs = [x for x in xs if x <= fits[-1]]
    total = sum(points[x] for x in xs)
    ws = [points[x] / total for x in xs]  # fractions of the replayed steps: no overflow, any scale
    if memory_budget is None or costs is None:
        chosen = _solve(xs, ws, None, max_graphs, 0.0)
    else:
        spare = memory_budget - costs.shared[xs[-1]]
        chosen = _within(xs, ws, [costs.per_size[x] for x in xs], max_graphs, spare)
    sizes = tuple(xs[i] for i in chosen)
    memory = None if costs is None else costs.bytes_of(sizes)
    return SizeChoice(sizes, dict(weights), constraints, eager, memory)


def _checked(histogram: Mapping[int, float]) -> dict[int, float]:
    if not isinstance(histogram, Mapping):
        raise ValueError(f"histogram must map token counts to step counts; got {type(histogram).__name__}")
    out: dict[int, float] = {}
    for n, w in histogram.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"histogram token count must be an integer >= 1; got {n!r}")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise ValueError(f"histogram count of {n} tokens must be a finite number >= 0; got {w!r}")
        if w > 0:
            out[n] = float(w)
    if not out:
        raise ValueError("histogram holds no step (every count is 0)")
    if not math.isfinite(sum(out.values())):
        raise ValueError("histogram counts sum to infinity; scale them down (they are relative weights)")
    return out


def _points(weights: dict[int, float], constraints: SizeConstraints) -> tuple[dict[int, float], dict[int, float]]:
    """({size a count rounds up to: its steps}, {count that runs eagerly: its steps})."""
    q = constraints.multiple_of
    points: dict[int, float] = {}
    eager: dict[int, float] = {}
    for n, w in weights.items():
        x = _round_up(n, q)
        if x > constraints.largest or (constraints.uniform_only and n % q):
            eager[n] = w
        else:
            points[x] = points.get(x, 0.0) + w
    return points, eager


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def _solve(xs: list[int], ws: list[float], costs: list[int] | None, max_graphs: int, lam: float) -> list[int]:
    """Indices of the sizes minimising padded tokens (+ `lam` * bytes), ending at the last point."""
    finals, parents = _layers(xs, ws, [0.0] * len(xs) if costs is None else [lam * c for c in costs], max_graphs)
    best = min(range(len(finals)), key=finals.__getitem__)  # ties keep the fewer graphs
    return _path(parents, best, len(xs))


def _layers(xs: list[int], ws: list[float], extra: list[float], max_graphs: int) -> tuple[list[float], list]:
    """The dynamic program: `finals[k]`, the least cost of holding every point with `k + 1` sizes,
    and the parents that rebuild each schedule (`_path`).

    `f[k][j]`: the least cost of holding points `0..j` with `k + 1` sizes, the last at `j`;
    `f[k][j] = x_j * P[j+1] + extra_j + min_i (f[k-1][i] - x_j * P[i+1])` over `i < j`, where
    `P` are prefix sums of the weights. Each `i` is a line in `x_j` whose slope `-P[i+1]` falls
    as `i` grows, and queries `x_j` grow, so a deque of the lower envelope answers each in O(1).
    """
    m = len(xs)
    prefix = [0.0]
    for w in ws:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    f = [xs[j] * prefix[j + 1] + extra[j] for j in range(m)]
    finals, parents = [f[m - 1]], []
    for k in range(1, min(max_graphs, m)):
        g, parent = [inf] * m, [-1] * m
        hull: deque[tuple[float, float, int]] = deque()  # (intercept f[i], slope -P[i+1], i)
        for j in range(k, m):
            i = j - 1
            if f[i] < inf:
                line = (f[i], -prefix[i + 1], i)
                while len(hull) >= 2 and _useless(hull[-2], hull[-1], line):
                    hull.pop()
                hull.append(line)
            x = xs[j]
            while len(hull) >= 2 and hull[1][0] + hull[1][1] * x <= hull[0][0] + hull[0][1] * x:
                hull.popleft()
            a, b, i = hull[0]
            g[j], parent[j] = x * prefix[j + 1] + extra[j] + a + b * x, i
        parents.append(parent)
        f = g
        finals.append(f[m - 1])
    return finals, parents


def _path(parents: list[list[int]], k: int, m: int) -> list[int]:
    """The point indices of the best schedule of `k + 1` sizes of `m` points (the last is one)."""
    j = m - 1
    chosen = [j]
    for layer in range(k, 0, -1):
        j = parents[layer - 1][j]
        chosen.append(j)
    return chosen[::-1]


def _useless(l1: tuple[float, float, int], l2: tuple[float, float, int], l3: tuple[float, float, int]) -> bool:
    # Slopes fall from l1 to l3: l2 is never the lowest when l3 overtakes l1 no later than l2 does.
    return (l3[0] - l1[0]) * (l1[1] - l2[1]) <= (l2[0] - l1[0]) * (l1[1] - l3[1])


_BISECTIONS = 50
"""Halvings of the byte price: the bracket ends `2**-50` of its start apart."""


def _within(xs: list[int], ws: list[float], costs: list[int], max_graphs: int, spare: int) -> list[int]:
    """The schedule with the least padding whose sizes' own bytes stay within `spare`.

    A Lagrangian search: at a price `lam` per byte, the dynamic program gives the best schedule
    of every graph count; the best of those that fit is kept, over `lam = 0` (so never more
    padding than an unconstrained optimum with fewer graphs that fits) and a bisection of `lam`.
    It may miss a schedule off the convex hull of the padding/bytes trade-off.
    """
    m = len(xs)
    prefix = [0.0]
    for w in ws:
        prefix.append(prefix[-1] + w)
    best, best_padding = [m - 1], math.inf

    def fits_at(lam: float) -> bool:
        """Keep the best fitting schedule at price `lam`; whether the priced optimum fits."""
        nonlocal best, best_padding
        finals, parents = _layers(xs, ws, [lam * c for c in costs], max_graphs)
        optimum = _path(parents, min(range(len(finals)), key=finals.__getitem__), m)
        for k, total in enumerate(finals):
            trial = _path(parents, k, m) if total < math.inf else []
            if not trial or sum(costs[i] for i in trial) > spare:
                continue
            padding = sum(xs[j] * (prefix[j + 1] - prefix[i + 1]) for i, j in zip([-1, *trial], trial))
            if padding < best_padding:
                best, best_padding = trial, padding
        return sum(costs[i] for i in optimum) <= spare

    if fits_at(0.0):
        return best
    # Schedules differ in bytes by multiples of `unit`, and in padding per step by less than the
    # largest size: at the price `hi` the fewest bytes win (the largest size alone, which fits).
    lo, hi = 0.0, (xs[-1] + 1) / math.gcd(*costs)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if fits_at(mid):
            hi = mid
        else:
            lo = mid
    return best
