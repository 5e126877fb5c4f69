"""`StepStats`: counters of executed steps (graph hits per key, eager fallbacks by reason, waste)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from graphcap.keys.key import planned_order

__all__ = ["StepStats"]


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
            "graph_hits": {str(k): v for k, v in sorted(self.graph_hits.items(), key=lambda kv: planned_order(kv[0]))},
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
