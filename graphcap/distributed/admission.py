"""Agreed admission under `capture.memory_budget`: every rank keeps a key only if every rank's budget admits it.

Each rank's graphs may differ in size (a vocab-parallel head split unevenly: 40 and 24 logits
columns), so a budget between two ranks' totals admits different keys on each, and a step would
then replay a key one rank lacks (gloo pairs a replay's collectives with an eager forward's).
`agreed_admission` cuts every rank's admitted keys to those every rank admitted (a subset of what
a rank admitted stays within its budget), before anything is captured.
"""

from __future__ import annotations

from typing import Any

from graphcap.keys import GraphKey
from graphcap.memory.budget import OVER_BUDGET
from graphcap.report import GraphRecord

__all__ = ["agreed_admission"]

CHUNK = 62
"""Keys per agreement: a rank's mask of declined keys is one int64 value >= 0."""


def agreed_admission(
    peers: Any, keys: list[GraphKey], admitted: list[GraphKey], declined: list[GraphRecord]
) -> tuple[list[GraphKey], list[GraphRecord]]:
    """(`admitted` cut to the keys every rank admitted, `declined` with the others) (collective: `peers` is the
    manager's `StepAgreement`; every rank's mask of the keys it declined, OR-ed over the DP, then the TP group)."""
    local = set(admitted)
    kept: set[GraphKey] = set()
    for start in range(0, len(keys), CHUNK):
        chunk = keys[start : start + CHUNK]
        mask = sum(1 << i for i, key in enumerate(chunk) if key not in local)
        for sync in peers.syncs:
            for value in sync.agree(peers.steps, "budget", value=mask, detail=str(chunk[0])).values:
                mask |= value
        kept |= {key for i, key in enumerate(chunk) if not mask >> i & 1}
    reason = (
        f"{OVER_BUDGET}: a parallel rank's graphs would cross its capture.memory_budget with it (every rank keeps "
        "the same keys); raise the budget or capture fewer sizes"
    )
    declined = declined + [GraphRecord(key, "skipped", 0.0, 0, False, reason) for key in admitted if key not in kept]
    return [key for key in admitted if key in kept], declined
