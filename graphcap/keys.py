"""Graph keys and dispatch: `GraphKey`, the `Mode` a step runs in, and `KeyRegistry`, the one place keys are made.

Keys come from the config once (mode, sizes, uniform query length, request limit). The
capture loop marks each key captured or skipped; `dispatch` maps a step's counts to a
captured key in O(1) (one padding-table index per kind) and says how the step runs (`Mode`):
a full graph, a piecewise graph, or eagerly with an explicit reason. As in vLLM's dispatcher,
the mode travels beside the key and graphs trust the key they are given, so every key used
anywhere (planning, dispatch, data-parallel agreement, capture batches, eager steps) comes
from this module.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from graphcap.sizing.sizes import CaptureSizes, uniform_sizes

__all__ = [
    "EAGER_REASONS",
    "MIXED_ROWS_FLOOR",
    "MIXED_ROWS_STEP",
    "Dispatch",
    "GraphKey",
    "KeyRegistry",
    "Mode",
    "StepStats",
    "mixed_request_rows",
]


class GraphKey(NamedTuple):
    """Identity of one graph (or of an eager step); made only by `KeyRegistry`.

    `num_tokens`: the padded token count T (a captured size). `num_reqs`: the padded request
    count R (rows of `query_start_loc[:R+1]`, `seq_lens`, `block_table`), or None for a graph
    that holds any request count (a piecewise graph: its pieces read no request rows, so a
    step stages its own count, unpadded). `uniform`: every real request has exactly `T / R`
    tokens (a decode or spec-decode step), which attention backends may exploit.
    """

    num_tokens: int
    num_reqs: int | None
    uniform: bool

    @property
    def piecewise(self) -> bool:
        """Whether the key holds any request count (the key of a piecewise graph)."""
        return self.num_reqs is None

    def __str__(self) -> str:
        if self.num_reqs is None:
            return f"piecewise(tokens={self.num_tokens})"
        kind = "uniform" if self.uniform else "mixed"
        return f"{kind}(tokens={self.num_tokens}, reqs={self.num_reqs})"


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
    "too_many_requests": "more requests than the key holds (batching.max_num_seqs)",
    "decode_only": "a mixed (not uniform) batch under capture.mode full_decode_only",
    "skipped": "its key failed to capture and was skipped (capture.on_error: skip)",
    "not_captured": "its key has not been captured yet (call capture() first)",
    "peer": "another data-parallel rank could not use a graph this step",
    "released": "the graphs were released (manager.release()); capture() serves again",
    "kv_resized": "the KV cache was resized (manager.resize_kv()); capture() again against the new cache",
    "pending": "capture.strategy is lazy and its key is not captured yet (manager.capture_pending() captures it)",
    "over_budget": "its graph would take the graphs past capture.memory_budget",
    "no_speedup": "its replay was not capture.min_speedup times faster than eager at capture",
    "over_padding": "its graph would compute more than capture.max_padding_factor times its real tokens",
}
"""Why a step ran eagerly; the keys of `CaptureManager.stats.eager`."""


MIXED_ROWS_STEP = 4
"""Each smaller request-row count of a mixed size is this many times fewer rows."""
MIXED_ROWS_FLOOR = 64
"""No mixed key gets fewer request rows than this by the ladder (below it padded rows cost little)."""


def mixed_request_rows(size: int, max_num_seqs: int, max_model_len: int | None = None) -> tuple[int, ...]:
    """Request-row counts of the mixed keys of `size` tokens, ascending.

    `min(size, max_num_seqs)` (any step of `size` tokens fits), then `MIXED_ROWS_STEP` times
    fewer (rounded down to a multiple of 8) while that leaves at least `MIXED_ROWS_FLOOR` rows
    and `ceil(size / max_model_len)` (the requests `size` tokens need at least). A
    mixed step of 256 requests and 2304 tokens then pads to 256 rows, not 1024: rows that a
    step does not use still cost the upload, the attention kernels' grid and the host-side
    planning of every padded request.
    """
    capacity = min(size, max_num_seqs)
    least = 1 if not max_model_len else -(-size // max_model_len)
    rows = [capacity]
    while True:
        smaller = rows[-1] // MIXED_ROWS_STEP // 8 * 8
        if smaller < MIXED_ROWS_FLOOR or smaller < least or smaller >= rows[-1]:
            break
        rows.append(smaller)
    return tuple(reversed(rows))


class KeyRegistry:
    """Keys planned from a config, their capture state, and the dispatch table.

    Mixed keys (mode `full`): per size, one per `mixed_request_rows(size, max_num_seqs,
    max_model_len)` row count, `min(size, max_num_seqs)` and, for large sizes, a few with
    fewer request rows; a mixed step replays the one with the fewest rows that hold it.
    Uniform keys: `num_reqs = size / q` at every size `sizes.uniform_sizes` gives (modes
    `full`, `full_decode_only` and `full_and_piecewise`): sizes of whole requests within
    `max_num_seqs`, plus `max_num_seqs * q` itself. Piecewise keys (modes `piecewise` and
    `full_and_piecewise`): one per size, `num_reqs` None; every step up to the largest size
    that has no uniform key replays one. Mode `none` plans nothing. Does not stage or run anything.
    """

    def __init__(
        self,
        sizes: CaptureSizes,
        mode: str,
        uniform_query_len: int,
        max_num_seqs: int,
        max_model_len: int | None = None,
        max_padding_factor: float | None = None,
    ) -> None:
        self.sizes = sizes
        self.mode = mode
        self.uniform_query_len = q = uniform_query_len
        self.max_num_seqs = max_num_seqs
        planned: list[GraphKey] = []
        # Index by token count: the dispatch hot path is one list index per kind (mixed: the
        # size's keys by ascending request rows).
        self._uniform: list[GraphKey | None] = [None] * (sizes.max_size + 1)
        self._mixed: list[tuple[GraphKey, ...]] = [()] * (sizes.max_size + 1)
        self._piecewise: list[GraphKey | None] = [None] * (sizes.max_size + 1)
        if mode != "none":
            uniform = [GraphKey(size, size // q, True) for size in uniform_sizes(sizes, q, max_num_seqs)]
            mixed = (
                [
                    GraphKey(size, rows, False)
                    for size in sizes
                    for rows in mixed_request_rows(size, max_num_seqs, max_model_len)
                ]
                if mode == "full"
                else []
            )
            if mode == "piecewise":
                uniform = []
            pieces = [GraphKey(size, None, False) for size in sizes] if "piecewise" in mode else []
            planned = uniform + mixed + pieces
            if pieces:
                by_size_pieces = {key.num_tokens: key for key in pieces}
                self._piecewise = [by_size_pieces[sizes.pad(n)] for n in range(sizes.max_size + 1)]
            # Each token count maps to the smallest key that holds it. A uniform key is used
            # only where it pads no further than the schedule does (its size <= pad(n)).
            fill = iter(uniform)
            key = next(fill, None)
            for n in range(sizes.max_size + 1):
                while key is not None and key.num_tokens < n:
                    key = next(fill, None)
                if key is not None and key.num_tokens <= sizes.pad(n):
                    self._uniform[n] = key
            if mixed:
                by_size: dict[int, tuple[GraphKey, ...]] = {}
                for key in mixed:
                    by_size[key.num_tokens] = (*by_size.get(key.num_tokens, ()), key)
                self._mixed = [by_size[sizes.pad(n)] for n in range(sizes.max_size + 1)]
        # The padding factor folded into the tables once: a uniform key past it is dropped from its
        # counts, and `_over_padding[n]` marks the counts whose schedule size is past it.
        self.max_padding_factor = max_padding_factor
        self._over_padding = [False] * (sizes.max_size + 1)
        if max_padding_factor is not None:
            for n in range(1, sizes.max_size + 1):
                limit = max_padding_factor * n
                self._over_padding[n] = sizes.pad(n) > limit
                key = self._uniform[n]
                if key is not None and key.num_tokens > limit:
                    self._uniform[n] = None
        self.planned: tuple[GraphKey, ...] = tuple(sorted(planned, key=_ascending))
        self._order = tuple(sorted(self.planned, key=lambda k: (-k.num_tokens, *_ascending(k)[1:])))
        self.captured: set[GraphKey] = set()
        self.skipped: dict[GraphKey, str] = {}
        self.declined: dict[GraphKey, str] = {}
        """Of `skipped`, keys left uncaptured by choice: the eager reason (`over_budget`, `no_speedup`)."""
        self.uncaptured_reason = "not_captured"
        """Why a planned key without a graph runs eagerly: `not_captured`, `pending`, or what freed its graph."""
        self.demand: Counter = Counter()
        """Eager steps per planned key that was not captured (the traffic lazy capture orders keys by)."""

    @classmethod
    def from_config(cls, config) -> KeyRegistry:
        registry = cls(
            config.capture_sizes,
            config.capture.mode,
            config.capture.uniform_query_len,
            config.batching.max_num_seqs,
            config.kv_cache.max_model_len,
            config.capture.max_padding_factor,
        )
        if config.capture.strategy == "lazy":
            registry.uncaptured_reason = "pending"
        return registry

    def capture_order(self) -> list[GraphKey]:
        """Largest first (smaller graphs then reuse the pool); uniform before mixed; more rows first."""
        return list(self._order)

    def mode_of(self, key: GraphKey) -> Mode:
        """How a planned key's graph runs: `PIECEWISE` for a key of any request count, else `FULL`."""
        return Mode.PIECEWISE if key.num_reqs is None else Mode.FULL

    def capture_shape(self, key: GraphKey) -> GraphKey:
        """The padded counts of the batches that capture and verify `key` (`dummy_batch`, `probe_batch`).

        The key itself, or for a piecewise key its tokens over as many requests as a step of
        that size can have (`min(T, max_num_seqs)`), so its capture batches have padded requests.
        """
        if key.num_reqs is not None:
            return key
        return GraphKey(key.num_tokens, min(key.num_tokens, self.max_num_seqs), False)

    def mark_captured(self, key: GraphKey) -> None:
        self._check_planned(key)
        self.skipped.pop(key, None)
        self.captured.add(key)

    def mark_skipped(self, key: GraphKey, reason: str, eager_reason: str = "skipped") -> None:
        """`key` runs eagerly from now on (`reason`: the report's words; `eager_reason`: its `stats.eager` key)."""
        self._check_planned(key)
        self.captured.discard(key)
        self.skipped[key] = reason
        if eager_reason != "skipped":
            self.declined[key] = eager_reason

    def pending(self) -> list[GraphKey]:
        """Planned keys neither captured nor skipped, in `capture_order`."""
        return [key for key in self._order if key not in self.captured and key not in self.skipped]

    @property
    def num_pending(self) -> int:
        """How many keys `pending()` holds, in O(1): `captured` and `skipped` are disjoint sets of planned keys."""
        return len(self.planned) - len(self.captured) - len(self.skipped)

    def reset(self, reason: str = "not_captured") -> None:
        """Forget capture state (keys stay planned); `reason`: why steps run eagerly until a capture
        (`released`, `kv_resized`)."""
        self.captured.clear()
        self.skipped.clear()
        self.declined.clear()
        self.uncaptured_reason = reason

    def dispatch(self, num_tokens: int, num_reqs: int, uniform: bool, *, count: bool = True) -> Dispatch:
        """How a step of these counts runs: its captured key and mode, or eagerly with a reason.

        `uniform`: every request of the step has exactly `uniform_query_len` tokens (an empty
        step is uniform). A uniform step prefers its uniform key and falls back to the mixed
        (or piecewise) key of its size; a key that was skipped or not captured yet is never
        returned. `count`: a key with no graph yet counts the step in `demand` (False: a look
        that is not the step's key, such as a data-parallel rank's own before the agreement, or
        `CaptureManager.dispatch()`, a query). A step
        its graph would pad past `max_padding_factor` times its tokens runs eagerly (`over_padding`; a
        uniform step whose uniform key is within the factor but not captured: that key's reason).
        """
        if self.mode == "none":
            return self._eager(num_tokens, num_reqs, "mode_none")
        if num_tokens > self.sizes.max_size:
            return self._eager(num_tokens, num_reqs, "above_max_size")
        if uniform:
            key = self._uniform[num_tokens]
            if key is not None and key in self.captured:
                return Dispatch(Mode.FULL, key, "")
            if key is not None and count:  # traffic for its uniform key, whatever replays instead
                self.demand[key] += 1
            fallback = key
        else:
            fallback = None
        over = self._over_padding[num_tokens]  # every key of this count but the uniform one pads past the factor
        piece = self._piecewise[num_tokens]
        if piece is not None:  # piecewise keys hold any request count the buffers hold
            if over:
                return self._over_padding_of(num_tokens, num_reqs, fallback)
            if piece in self.captured:
                return Dispatch(Mode.PIECEWISE, piece, "")
            return self._eager(num_tokens, num_reqs, self._state(piece, count=count))
        keys = self._mixed[num_tokens]
        if not keys:  # full_decode_only plans no mixed keys
            reason = "decode_only" if fallback is None else self._state(fallback, count=False)
            return self._eager(num_tokens, num_reqs, reason)
        fits = None  # the fewest rows that hold the step; a larger captured one replays instead
        for key in keys:
            if key.num_reqs >= num_reqs:
                if over:
                    return self._over_padding_of(num_tokens, num_reqs, fallback)
                if key in self.captured:
                    return Dispatch(Mode.FULL, key, "")
                fits = fits or key
        if fits is None:
            return self._eager(num_tokens, num_reqs, "too_many_requests")
        return self._eager(num_tokens, num_reqs, self._state(fits, count=count))

    @staticmethod
    def eager_key(num_tokens: int, num_reqs: int) -> GraphKey:
        """The key of an eager step: the step's own counts, unpadded, mixed (no graph has it)."""
        return GraphKey(num_tokens, num_reqs, False)

    def _eager(self, num_tokens: int, num_reqs: int, reason: str) -> Dispatch:
        return Dispatch(Mode.EAGER, GraphKey(num_tokens, num_reqs, False), reason)

    def _over_padding_of(self, num_tokens: int, num_reqs: int, fallback: GraphKey | None) -> Dispatch:
        """A step whose keys pad past the factor: `over_padding`, or the reason of its own uniform key (not
        captured, within the factor)."""
        reason = "over_padding" if fallback is None else self._state(fallback, count=False)
        return self._eager(num_tokens, num_reqs, reason)

    def _state(self, key: GraphKey, *, count: bool = True) -> str:
        """Why a step whose key is `key` (not captured) runs eagerly; counts the step in `demand`."""
        if key in self.skipped:
            return self.declined.get(key, "skipped")
        if count:
            self.demand[key] += 1
        return self.uncaptured_reason

    def _check_planned(self, key: GraphKey) -> None:
        if key not in self.planned:
            raise ValueError(f"{key} is not a planned key; keys come from the registry, not call sites")

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self.planned)

    def __len__(self) -> int:
        return len(self.planned)


def _ascending(key: GraphKey) -> tuple:
    """Planned order: by size; uniform, then mixed (more rows first), then piecewise."""
    return (key.num_tokens, not key.uniform, key.num_reqs is None, -(key.num_reqs or 0))


@dataclass
class StepStats:
    """Counters of executed steps (graph hits per key, eager fallbacks by reason, waste)."""

    graph_hits: Counter = field(default_factory=Counter)
    """Replays per `GraphKey`."""
    eager: Counter = field(default_factory=Counter)
    """Eager steps per reason (keys of `graphcap.keys.EAGER_REASONS`)."""
    real_tokens: int = 0
    """Real tokens of replayed steps."""
    padded_tokens: int = 0
    """Tokens the replayed graphs computed (real + padding)."""
    eager_op_calls: int = 0
    """`eager_op` calls run between the pieces of piecewise replays."""
    eager_op_copies: int = 0
    """Of those, calls whose result was copied into its static tensor (ops without `out=`)."""
    captures: int = 0
    """Capture passes completed: every `capture()` (the first, then every re-capture), and every
    `capture_pending()` call that captured a key (lazy capture's passes, one per idle-time call)."""
    graphs_captured: int = 0
    """Graphs captured and kept, by `capture()` and `capture_pending()` (a re-capture's count again)."""
    releases: int = 0
    """`release()` and `resize_kv()` calls (each frees every graph)."""
    graphs_released: int = 0
    """Graphs freed by `release()`, `resize_kv()` or a re-capture replacing them."""

    @property
    def piecewise_replays(self) -> int:
        """Replays of piecewise keys (`graph_hits` holds them by key, with the full graphs')."""
        return sum(n for key, n in self.graph_hits.items() if key.num_reqs is None)

    @property
    def padded_token_waste(self) -> float:
        """Fraction of replayed tokens that were padding."""
        return 0.0 if not self.padded_tokens else 1.0 - self.real_tokens / self.padded_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "graph_hits": {str(k): v for k, v in sorted(self.graph_hits.items(), key=lambda kv: _ascending(kv[0]))},
            "eager": dict(self.eager),
            "steps": sum(self.graph_hits.values()) + sum(self.eager.values()),
            "piecewise_replays": self.piecewise_replays,
            "padded_token_waste": self.padded_token_waste,
            "eager_op_calls": self.eager_op_calls,
            "eager_op_copies": self.eager_op_copies,
            "captures": self.captures,
            "graphs_captured": self.graphs_captured,
            "releases": self.releases,
            "graphs_released": self.graphs_released,
        }
