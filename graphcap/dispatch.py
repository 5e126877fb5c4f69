"""`KeyRegistry`: the one source of truth for which graph keys exist, and step dispatch.

Keys come from the config once (mode, sizes, uniform query length, request limit). The
capture loop marks each key captured or skipped; `dispatch` maps a step's counts to a
captured key in O(1) (one padding-table index per kind) or to the named eager key with an
explicit reason. The runtime contract, as in vLLM's dispatcher: graphs trust the key they
are given, so every key used anywhere (planning, dispatch, data-parallel agreement, eager
steps) comes from this class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from graphcap.batch import GraphKey, StepBatch
from graphcap.sizes import CaptureSizes, uniform_sizes

__all__ = ["EAGER_REASONS", "MIXED_ROWS_FLOOR", "MIXED_ROWS_STEP", "KeyRegistry", "StepStats", "mixed_request_rows"]

EAGER_REASONS = {
    "mode_none": "capture.mode is none",
    "above_max_size": "more tokens than the largest captured size (capture.max_size)",
    "too_many_requests": "more requests than the key holds (batching.max_num_seqs)",
    "decode_only": "a mixed (not uniform) batch under capture.mode full_decode_only",
    "skipped": "its key failed to capture and was skipped (capture.on_error: skip)",
    "not_captured": "its key has not been captured yet (call capture() first)",
    "peer": "another data-parallel rank could not use a graph this step",
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
    `full_and_piecewise`): one per size, keyed by token count alone (`num_reqs` 0); every step
    up to the largest size that has no uniform key replays one. Mode `none` plans nothing.
    Does not stage or run anything.
    """

    def __init__(
        self,
        sizes: CaptureSizes,
        mode: str,
        uniform_query_len: int,
        max_num_seqs: int,
        max_model_len: int | None = None,
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
            pieces = [GraphKey(size, 0, False, True) for size in sizes] if "piecewise" in mode else []
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
        self.planned: tuple[GraphKey, ...] = tuple(
            sorted(planned, key=lambda k: (k.num_tokens, not k.uniform, k.piecewise, -k.num_reqs))
        )
        self.captured: set[GraphKey] = set()
        self.skipped: dict[GraphKey, str] = {}

    @classmethod
    def from_config(cls, config) -> KeyRegistry:
        return cls(
            config.capture_sizes,
            config.capture.mode,
            config.capture.uniform_query_len,
            config.batching.max_num_seqs,
            config.kv_cache.max_model_len,
        )

    def capture_order(self) -> list[GraphKey]:
        """Largest first (smaller graphs then reuse the pool); uniform before mixed; more rows first."""
        return sorted(self.planned, key=lambda k: (-k.num_tokens, not k.uniform, k.piecewise, -k.num_reqs))

    def mark_captured(self, key: GraphKey) -> None:
        self._check_planned(key)
        self.skipped.pop(key, None)
        self.captured.add(key)

    def mark_skipped(self, key: GraphKey, reason: str) -> None:
        self._check_planned(key)
        self.captured.discard(key)
        self.skipped[key] = reason

    def reset(self) -> None:
        """Forget capture state (keys stay planned)."""
        self.captured.clear()
        self.skipped.clear()

    def dispatch(self, num_tokens: int, num_reqs: int, uniform: bool) -> tuple[GraphKey | None, str]:
        """`(key, "")` for the captured key that holds a step, else `(None, reason)`.

        `uniform`: every request of the step has exactly `uniform_query_len` tokens (an empty
        step is uniform). A uniform step prefers its uniform key and falls back to the mixed
        key of its size; a key that was skipped or not captured yet is never returned.
        """
        if self.mode == "none":
            return None, "mode_none"
        if num_tokens > self.sizes.max_size:
            return None, "above_max_size"
        if uniform:
            key = self._uniform[num_tokens]
            if key is not None and key in self.captured:
                return key, ""
            fallback = key
        else:
            fallback = None
        piece = self._piecewise[num_tokens]
        if piece is not None:  # piecewise keys hold any request count the buffers hold
            return (piece, "") if piece in self.captured else (None, self._state(piece))
        keys = self._mixed[num_tokens]
        if not keys:  # full_decode_only plans no mixed keys
            return None, "decode_only" if fallback is None else self._state(fallback)
        fits = None  # the fewest rows that hold the step; a larger captured one replays instead
        for key in keys:
            if key.num_reqs >= num_reqs:
                if key in self.captured:
                    return key, ""
                fits = fits or key
        if fits is None:
            return None, "too_many_requests"
        return None, self._state(fits)

    def key_for(self, batch: StepBatch) -> tuple[GraphKey | None, str]:
        """`dispatch` for a `StepBatch` (its counts and whether it is uniform)."""
        return self.dispatch(batch.num_tokens, batch.num_reqs, batch.is_uniform(self.uniform_query_len))

    @staticmethod
    def staging_key(key: GraphKey, num_reqs: int) -> GraphKey:
        """The key a step stages with: `key` itself, or for a piecewise key its tokens with the
        step's own request count (piecewise graphs read no request rows, so none are padded)."""
        return GraphKey(key.num_tokens, num_reqs, False, True) if key.piecewise else key

    @staticmethod
    def eager_key(num_tokens: int, num_reqs: int) -> GraphKey:
        """The key of an eager step: the step's own counts, unpadded, mixed (no graph has it)."""
        return GraphKey(num_tokens, num_reqs, False)

    def _state(self, key: GraphKey) -> str:
        return "skipped" if key in self.skipped else "not_captured"

    def _check_planned(self, key: GraphKey) -> None:
        if key not in self.planned:
            raise ValueError(f"{key} is not a planned key; keys come from the registry, not call sites")

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self.planned)

    def __len__(self) -> int:
        return len(self.planned)


@dataclass
class StepStats:
    """Counters of executed steps (graph hits per key, eager fallbacks by reason, waste)."""

    graph_hits: Counter = field(default_factory=Counter)
    """Replays per `GraphKey`."""
    eager: Counter = field(default_factory=Counter)
    """Eager steps per reason (keys of `graphcap.dispatch.EAGER_REASONS`)."""
    real_tokens: int = 0
    """Real tokens of replayed steps."""
    padded_tokens: int = 0
    """Tokens the replayed graphs computed (real + padding)."""
    eager_op_calls: int = 0
    """`eager_op` calls run between the pieces of piecewise replays."""
    eager_op_copies: int = 0
    """Of those, calls whose result was copied into its static tensor (ops without `out=`)."""

    @property
    def piecewise_replays(self) -> int:
        """Replays of piecewise keys (`graph_hits` holds them by key, with the full graphs')."""
        return sum(n for key, n in self.graph_hits.items() if key.piecewise)

    @property
    def padded_token_waste(self) -> float:
        """Fraction of replayed tokens that were padding."""
        return 0.0 if not self.padded_tokens else 1.0 - self.real_tokens / self.padded_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "graph_hits": {str(k): v for k, v in sorted(self.graph_hits.items())},
            "eager": dict(self.eager),
            "steps": sum(self.graph_hits.values()) + sum(self.eager.values()),
            "piecewise_replays": self.piecewise_replays,
            "padded_token_waste": self.padded_token_waste,
            "eager_op_calls": self.eager_op_calls,
            "eager_op_copies": self.eager_op_copies,
        }
