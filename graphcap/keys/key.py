"""`GraphKey`, the `Mode` a step runs in, `Dispatch` (the decision with its reason) and the eager reasons.

Every key used anywhere (planning, dispatch, data-parallel agreement, capture batches, eager steps)
is a `GraphKey` made by `KeyRegistry` (`graphcap.keys.registry`); this room holds the types alone.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["EAGER_REASONS", "Dispatch", "GraphKey", "Mode", "planned_order", "reason_kind"]


class GraphKey(NamedTuple):
    """Identity of one graph (or of an eager step); made only by `KeyRegistry`.

    `num_tokens`: the padded token count T (a captured size). `num_reqs`: the padded request
    count R (rows of `query_start_loc[:R+1]`, `seq_lens`, `block_table`), or None for a graph
    that holds any request count (a piecewise graph: its pieces read no request rows, so a
    step stages its own count, unpadded). `uniform`: every real request has exactly `T / R`
    tokens (a decode or spec-decode step), which attention backends may exploit. `axes`: the
    value of every key axis (`capture.axes`) as `(name, value)` pairs in the config's order, empty
    without axes; the model reads them as `inputs.axes` (a capture-time constant of the graph).
    """

    num_tokens: int
    num_reqs: int | None
    uniform: bool
    axes: tuple[tuple[str, int], ...] = ()

    @property
    def piecewise(self) -> bool:
        """Whether the key holds any request count (the key of a piecewise graph)."""
        return self.num_reqs is None

    @property
    def base(self) -> GraphKey:
        """The key's token part, without its axis values."""
        return GraphKey(self.num_tokens, self.num_reqs, self.uniform) if self.axes else self

    def __str__(self) -> str:
        axes = "".join(f", {name}={value}" for name, value in self.axes)
        if self.num_reqs is None:
            return f"piecewise(tokens={self.num_tokens}{axes})"
        kind = "uniform" if self.uniform else "mixed"
        return f"{kind}(tokens={self.num_tokens}, reqs={self.num_reqs}{axes})"


class Mode(str, enum.Enum):
    """How a step runs: the mode `KeyRegistry.dispatch` returns beside its key."""

    FULL = "full"
    """Replay the key's full graph (the whole forward, no Python)."""
    PIECEWISE = "piecewise"
    """Replay the key's pieces, with the eager ops between them on the real batch."""
    EAGER = "eager"
    """Run the forward eagerly, unpadded (the key is the step's own counts)."""

    def __str__(self) -> str:
        return self.value


class Dispatch(NamedTuple):
    """What `KeyRegistry.dispatch` decided for one step."""

    mode: Mode
    key: GraphKey
    """The captured key to replay; for `Mode.EAGER` the step's own counts, unpadded."""
    reason: str
    """Why the step runs eagerly (a key of `EAGER_REASONS`); "" for a graph."""


EAGER_REASONS = {
    "mode_none": "capture.mode is none",
    "above_max_size": "more tokens than the largest captured size (capture.max_size)",
    "decode_only": "a mixed (not uniform) batch under capture.mode full_decode_only",
    "skipped": "its key failed to capture and was skipped (capture.on_error: skip)",
    "not_captured": "its key has not been captured yet (call capture() first)",
    "peer": "another data-parallel rank could not use a graph this step",
    "released": "the graphs were released (manager.release()); capture() serves again",
    "kv_resized": "the KV cache was resized (manager.resize_kv()); capture() again against the new cache",
    "pending": "capture.strategy is lazy and its key is not captured yet (manager.capture_pending() captures it)",
    "over_budget": "its graph would take the graphs past capture.memory_budget",
    "no_speedup": "its replay was not capture.min_speedup times faster than eager at capture",
    "above_max_axis": "an axis value above the largest of capture.axes.NAME (counted as above_max_axis.NAME)",
    "no_axis_combination": "no combination of capture.axis_combinations holds the step's axis values",
    "over_padding": "its graph would compute more than capture.max_padding_factor times its real tokens",
}
"""Why a step ran eagerly; the keys of `CaptureManager.stats.eager` (`reason_kind` of each: a reason that
names an axis, `above_max_axis.lora`, is counted under its own name)."""


NOT_CAPTURED_WARNING = (
    "execute() ran a step eagerly: no graph is captured for its key (capture() has not run since the manager was "
    "made or reset()), and every step runs eagerly until one is; call manager.capture() at start-up, or set "
    "capture.strategy: lazy to serve at once and capture in idle time (manager.capture_pending()). "
    "stats.eager['not_captured'] counts these steps; logged once per manager"
)
"""What the first step a manager runs eagerly for `not_captured` logs (a warning of the `graphcap` logger)."""


def reason_kind(reason: str) -> str:
    """The `EAGER_REASONS` key of an eager reason (`above_max_axis.lora` -> `above_max_axis`)."""
    return reason.partition(".")[0]


def planned_order(key: GraphKey) -> tuple[int, bool, bool, int, tuple[tuple[str, int], ...]]:
    """Planned order: by size; uniform, then mixed (more rows first), then piecewise; then by axis values."""
    return (key.num_tokens, not key.uniform, key.num_reqs is None, -(key.num_reqs or 0), key.axes)
