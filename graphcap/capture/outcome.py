"""`KeyOutcome`: what a capture pass decided for one key, and the typed results of its stages.

A key's outcome says whether it has a graph (`status`), what it cost, what verified it, and, for a key left out,
why in words (`message`) and as the eager reason its steps are counted under (`eager_reason`, a key of
`EAGER_REASONS`, set by the stage that decides it: `no_speedup` by the timing, `over_budget` by the budget's
split; None for a key that failed, counted as `skipped`). The report's `GraphRecord` is derived from it
(`record`). `Recorded` and `Verified` pair an outcome with the key's graph, as the recorder and the verifier
hand them on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from graphcap.backends import CapturedGraph
from graphcap.keys import EAGER_REASONS, GraphKey
from graphcap.report import GraphRecord

__all__ = ["KeyOutcome", "Recorded", "Verified"]


@dataclass(frozen=True, slots=True)
class KeyOutcome:
    """One key of a capture pass (the fields `GraphRecord` reports, and `eager_reason`)."""

    key: GraphKey
    status: Literal["captured", "skipped"]
    capture_seconds: float
    memory_bytes: int = 0
    verified: bool = False
    message: str = ""
    """Why a skipped key was skipped (the report's `reason`)."""
    eager_reason: str | None = None
    """The `EAGER_REASONS` key a skipped key's steps count under when it was left out by choice; None: `skipped`."""
    eager_seconds: float = 0.0
    pieces: int = 0
    eager_ops: int = 0
    speedup: float | None = None
    verified_fills: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.eager_reason is not None and self.eager_reason not in EAGER_REASONS:
            raise ValueError(f"eager_reason {self.eager_reason!r} is not a key of EAGER_REASONS")

    @property
    def counted_as(self) -> str:
        """The eager reason of a skipped key's steps: its own (`eager_reason`), else `skipped`."""
        return self.eager_reason or "skipped"

    def skipped(self, message: str, eager_reason: str | None = None, **changes: Any) -> KeyOutcome:
        """This key left out: no graph, no memory, `message` and `eager_reason` said (`changes`: other fields)."""
        fields: dict[str, Any] = {"memory_bytes": 0, "pieces": 0, "eager_ops": 0, **changes}
        return dataclasses.replace(self, status="skipped", message=message, eager_reason=eager_reason, **fields)

    def record(self) -> GraphRecord:
        """The report's record of this key."""
        return GraphRecord(
            self.key,
            self.status,
            self.capture_seconds,
            self.memory_bytes,
            self.verified,
            self.message,
            self.eager_seconds,
            pieces=self.pieces,
            eager_ops=self.eager_ops,
            speedup=self.speedup,
            verified_fills=self.verified_fills,
        )


class Recorded(NamedTuple):
    """A key after its recording: its outcome, and its graph (None: it failed and was skipped)."""

    outcome: KeyOutcome
    graph: CapturedGraph | None


class Verified(NamedTuple):
    """A key after its verification: its outcome (`verified`, or skipped), and the graph it keeps (None: none)."""

    outcome: KeyOutcome
    graph: CapturedGraph | None
