"""`MemoryBudget`: `capture.memory_budget`, the bytes the graphs may hold, applied key by key.

A key is captured only while graphcap's estimate of the graphs' memory, with it, stays within
the budget: the `graphs` part of `estimate_memory` over the keys kept so far and this one (on
CUDA the shared pool, the largest key's working set; on the emulated backend every graph's
static output). A key that would cross it is not captured: its report record is skipped with
the reason `over_budget: ...` and its steps run eagerly (eager reason `over_budget`), upfront or
lazy. Keys are admitted in the order they are captured (upfront: largest first; lazy: most
traffic first), so the keys that come first keep the budget.

Whose estimate: graphcap's arithmetic for its built-in `tiny-llama` built from this config; for any
other model (an object the engine passes, or a `model.factory` model) each key's figures measured
on that model (`graphcap.memory.measured`: one eager forward of the key's dummy batch before the
key is admitted, once per key). A factory model and a model object get the same decision.

On CUDA the manager also reserves the budget in the graph pool before the first capture
(`GraphBackend.reserve`, `GraphPool.reserve`), so a lazy capture later in the engine's life finds
its memory held by the pool instead of failing for lack of it; the report gives the measured pool
beside the estimate. What the reservation covers (`graphcap.backends.cuda.reservation_layout`):
one large block (every request over 1 MiB is carved from it) and 1/64 of the budget, one to 32
segments of 2 MiB, of small blocks (requests of 1 MiB or less are only ever served from those);
what a capture needs beyond either still takes fresh device memory. The reservation follows the
pool through rotations (a failed capture), goes back on `release()`, and is taken once per pool.
The emulated backend reserves nothing: it accounts the same estimate, so the budget logic is
tested on CPU.

The budget holds to graphcap's estimate, not to the memory the captures measure: the estimate
decides before a key is captured, the measure comes after. When the pool the live graphs'
captures measured grows past the budget although the estimate meets it (the model allocates more
than the estimate knows of), `overrun` words a warning naming both figures: `capture()` puts it
in the report's warnings and logs it, `capture_pending()` logs it when its captures cross.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from graphcap.config import CaptureConfig
from graphcap.config.byte_counts import format_bytes, parse_bytes
from graphcap.keys import GraphKey, KeyRegistry
from graphcap.memory.estimate import GraphMemory, estimate_memory, graphs_bytes
from graphcap.report import GraphRecord

__all__ = ["OVER_BUDGET", "MemoryBudget"]

OVER_BUDGET = "over_budget"
"""The eager reason of a key the budget left out, and the first word of its record's reason."""


class MemoryBudget:
    """The budget of one manager (`limit` None: every key fits) over `estimate_memory`'s per-key graphs, or
    over each key measured on the model (`measure`)."""

    def __init__(
        self, config: CaptureConfig, backend_name: str, measure: Callable[[GraphKey], GraphMemory] | None = None
    ) -> None:
        budget = config.capture.memory_budget  # bytes: the section parses a size such as 4GiB
        self.limit: int | None = parse_bytes(budget) if isinstance(budget, str) else budget
        self.pool_growth = 0
        """Device memory the captures of the live graphs added, as the pool measured it (`observe`)."""
        self.kind = "cuda" if backend_name == "cuda" else "emulated"
        """Which estimate applies: `cuda` (one shared pool) or `emulated` (each graph's output)."""
        self.measure = measure
        """A key's graph memory measured on the model (None: graphcap's arithmetic of its built-in model)."""
        self._measured: dict[GraphKey, GraphMemory] = {}

    def estimate(self, config: CaptureConfig, keys: Iterable[GraphKey]) -> int:
        """Estimated bytes the graphs of `keys` hold together (the `graphs` part of `estimate_memory`, or
        the measured figures of each key)."""
        costs = self._costs(config, keys := list(keys))
        return graphs_bytes([costs[key] for key in keys], self.kind)

    def split(
        self, config: CaptureConfig, keys: Iterable[GraphKey], held: Iterable[GraphKey]
    ) -> tuple[list[GraphKey], list[GraphRecord]]:
        """`keys` in order, as those to capture and the skipped records of those that would cross the budget.

        `held`: the keys whose graphs are live already (they count against the budget).
        """
        keys, held = list(keys), list(held)
        if self.limit is None:
            return keys, []
        costs = self._costs(config, [*held, *keys])
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

    def observe(self, grown: int, *, fresh: bool) -> bool:
        """The captures of one call added `grown` bytes (`fresh`: no graph was live before them); whether the
        measured total crossed the budget with them (it was within before)."""
        before = 0 if fresh else self.pool_growth
        self.pool_growth = before + grown
        return self.limit is not None and before <= self.limit < self.pool_growth

    def overrun(self, config: CaptureConfig, held: Iterable[GraphKey]) -> str | None:
        """A warning when the measured memory of the live graphs `held` is past the budget (None: within it)."""
        if self.limit is None or self.pool_growth <= self.limit:
            return None
        held = list(held)
        estimate, measured, limit = self.estimate(config, held), self.pool_growth, self.limit
        return (
            f"capture.memory_budget {format_bytes(limit)} holds to graphcap's estimate of the graphs "
            f"({format_bytes(estimate)} for the {len(held)} live graphs), not to measured memory: their captures "
            f"grew the pool by {format_bytes(measured)}, {measured / limit:.1f}x the budget. To keep device memory "
            "within it, lower capture.memory_budget by that ratio or capture fewer sizes"
        )

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

    def _costs(self, config: CaptureConfig, keys: list[GraphKey]) -> dict[GraphKey, GraphMemory]:
        if self.measure is None:
            if config.model.factory is not None:
                raise ValueError(f"model.factory {config.model.factory}: graphcap has no arithmetic for it; measure it")
            planned = KeyRegistry.from_config(config).planned
            return dict(zip(planned, estimate_memory(config, backend=self.kind).graphs, strict=True))
        for key in keys:
            if key not in self._measured:
                self._measured[key] = self.measure(key)
        return self._measured
