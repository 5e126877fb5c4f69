"""`MemoryBudget`: `capture.memory_budget`, the bytes the graphs may hold, applied key by key.

A key is captured only while graphcap's estimate of the graphs' memory, with it, stays within
the budget: the `graphs` part of `estimate_memory` over the keys kept so far and this one (on
CUDA the shared pool, the largest key's working set; on the emulated backend every graph's
static output). A key that would cross it is not captured: its report record is skipped with
the reason `over_budget: ...` and its steps run eagerly (eager reason `over_budget`), upfront or
lazy. Keys are admitted in the order they are captured (upfront: largest first; lazy: most
traffic first), so the keys that come first keep the budget.

On CUDA the manager also reserves the budget in the graph pool before the first capture
(`GraphBackend.reserve`), so a lazy capture later in the engine's life finds its memory held by
the pool instead of failing for lack of it; the report gives the measured pool beside the
estimate. The emulated backend reserves nothing: it accounts the same estimate, so the budget
logic is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from graphcap.config import CaptureConfig
from graphcap.config.byte_counts import format_bytes
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.keys import GraphKey, KeyRegistry
from graphcap.memory.estimate import estimate_memory, graphs_bytes
from graphcap.report import GraphRecord

__all__ = ["OVER_BUDGET", "MemoryBudget"]

OVER_BUDGET = "over_budget"
"""The eager reason of a key the budget left out, and the first word of its record's reason."""


class MemoryBudget:
    """The budget of one manager (`limit` None: every key fits) over `estimate_memory`'s per-key graphs."""

    def __init__(self, config: CaptureConfig, backend_name: str) -> None:
        self.limit: int | None = config.capture.memory_budget
        self.kind = "cuda" if backend_name == "cuda" else "emulated"
        """Which estimate applies: `cuda` (one shared pool) or `emulated` (each graph's output)."""
        if self.limit is not None and config.model.factory is not None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "capture.memory_budget",
                        f"model.factory {config.model.factory} has no per-graph memory estimate, so a budget "
                        "cannot be kept; leave capture.memory_budget null for a factory model",
                    )
                ]
            )

    def estimate(self, config: CaptureConfig, keys: Iterable[GraphKey]) -> int:
        """Estimated bytes the graphs of `keys` hold together (the `graphs` part of `estimate_memory`)."""
        if config.model.factory is not None:
            return 0
        costs = self._costs(config)
        return graphs_bytes([costs[key] for key in keys], self.kind)

    def split(
        self, config: CaptureConfig, keys: Iterable[GraphKey], held: Iterable[GraphKey]
    ) -> tuple[list[GraphKey], list[GraphRecord]]:
        """`keys` in order, as those to capture and the skipped records of those that would cross the budget.

        `held`: the keys whose graphs are live already (they count against the budget).
        """
        keys = list(keys)
        if self.limit is None:
            return keys, []
        costs = self._costs(config)
        kept = [costs[key] for key in held]
        admitted, declined = [], []
        for key in keys:
            total = graphs_bytes([*kept, costs[key]], self.kind)
            if total <= self.limit:
                admitted.append(key)
                kept.append(costs[key])
                continue
            reason = (
                f"{OVER_BUDGET}: the graphs would hold {format_bytes(total)} by graphcap's estimate with it, over "
                f"capture.memory_budget {format_bytes(self.limit)}; raise the budget or capture fewer sizes"
            )
            declined.append(GraphRecord(key, "skipped", 0.0, 0, False, reason))
        return admitted, declined

    def to_dict(
        self, config: CaptureConfig, held: Iterable[GraphKey], pool_bytes: int, backend: Any
    ) -> dict[str, Any] | None:
        """A report's `memory_budget` entry (None without a budget): the budget, the estimate of the live
        graphs `held`, the pool growth the pass measured and the bytes `backend` reserved for the graphs."""
        if self.limit is None:
            return None
        return {
            "budget_bytes": self.limit,
            "estimate_bytes": self.estimate(config, held),
            "pool_bytes": pool_bytes,
            "reserved_bytes": backend.reserved_bytes or 0,
        }

    def _costs(self, config: CaptureConfig) -> dict[GraphKey, Any]:
        keys = KeyRegistry.from_config(config).planned
        return dict(zip(keys, estimate_memory(config, backend=self.kind).graphs, strict=True))
