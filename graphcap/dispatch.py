"""`KeyRegistry`: the one source of truth for which graph keys exist, and step dispatch.

Keys come from the config once (mode, sizes, uniform query length, request limit). The
capture loop marks each key captured or skipped; `dispatch` maps a batch to a captured key
in O(1) (one padding-table index and one list index) or to an explicit eager reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from graphcap.batch import GraphKey, StepBatch
from graphcap.sizes import CaptureSizes

__all__ = ["EAGER_REASONS", "KeyRegistry", "StepStats"]

EAGER_REASONS = {
    "mode_none": "capture.mode is none",
    "above_max_size": "more tokens than the largest captured size (capture.max_size)",
    "too_many_requests": "more requests than the key holds (batching.max_num_seqs)",
    "decode_only": "a mixed batch under capture.mode full_decode_only",
    "skipped": "its key failed to capture and was skipped (capture.on_error: skip)",
    "not_captured": "its key has not been captured yet (call capture() first)",
    "peer": "another data-parallel rank could not use a graph this step",
}
"""Why a step ran eagerly; the keys of `CaptureManager.stats["eager"]`."""


class KeyRegistry:
    """Keys planned from a config, their capture state, and the dispatch table.

    Mixed keys: one per size, `num_reqs = min(size, max_num_seqs)` (mode `full`). Uniform
    keys: `num_reqs = size / q` where `q` divides the size and the requests fit (modes
    `full` and `full_decode_only`). Mode `none` plans nothing.
    """

    def __init__(self, sizes: CaptureSizes, mode: str, uniform_query_len: int, max_num_seqs: int) -> None:
        self.sizes = sizes
        self.mode = mode
        self.uniform_query_len = q = uniform_query_len
        self.max_num_seqs = max_num_seqs
        planned: list[GraphKey] = []
        # Index by padded size: the dispatch hot path is one list index per kind.
        self._uniform: list[GraphKey | None] = [None] * (sizes.max_size + 1)
        self._mixed: list[GraphKey | None] = [None] * (sizes.max_size + 1)
        if mode != "none":
            for size in sizes.sizes:
                if size % q == 0 and size // q <= max_num_seqs:
                    self._uniform[size] = key = GraphKey(size, size // q, True)
                    planned.append(key)
                if mode == "full":
                    self._mixed[size] = key = GraphKey(size, min(size, max_num_seqs), False)
                    planned.append(key)
        self.planned: tuple[GraphKey, ...] = tuple(planned)
        self.captured: set[GraphKey] = set()
        self.skipped: dict[GraphKey, str] = {}

    @classmethod
    def from_config(cls, config) -> KeyRegistry:
        return cls(
            config.capture_sizes
            if config.capture.mode != "none"
            else CaptureSizes([1], config.batching.max_num_tokens),
            config.capture.mode,
            config.capture.uniform_query_len,
            config.batching.max_num_seqs,
        )

    def capture_order(self) -> list[GraphKey]:
        """Largest first (smaller graphs then reuse the shared pool); uniform before mixed."""
        return sorted(self.planned, key=lambda k: (-k.num_tokens, not k.uniform))

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

    def dispatch(self, batch: StepBatch) -> tuple[GraphKey | None, str]:
        """`(key, "")` for a captured key that holds `batch`, else `(None, reason)`."""
        if self.mode == "none":
            return None, "mode_none"
        size = self.sizes.pad(batch.num_tokens)
        if size is None:
            return None, "above_max_size"
        uniform = self._uniform[size] if batch.is_uniform(self.uniform_query_len) else None
        if uniform is not None and uniform in self.captured:
            return uniform, ""
        key = self._mixed[size]
        if key is None:  # full_decode_only plans no mixed keys
            return None, "decode_only" if uniform is None else self._state(uniform)
        if batch.num_reqs > key.num_reqs:
            return None, "too_many_requests"
        if key in self.captured:
            return key, ""
        return None, self._state(key)

    def captured_key(self, size: int, uniform: bool) -> GraphKey | None:
        """The captured key for a padded `size`: uniform when asked and captured, else mixed."""
        if size > self.sizes.max_size:
            return None
        key = self._uniform[size] if uniform else None
        if key is not None and key in self.captured:
            return key
        key = self._mixed[size]
        return key if key is not None and key in self.captured else None

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

    @property
    def padded_token_waste(self) -> float:
        """Fraction of replayed tokens that were padding."""
        return 0.0 if not self.padded_tokens else 1.0 - self.real_tokens / self.padded_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "graph_hits": {str(k): v for k, v in sorted(self.graph_hits.items())},
            "eager": dict(self.eager),
            "steps": sum(self.graph_hits.values()) + sum(self.eager.values()),
            "padded_token_waste": self.padded_token_waste,
        }
