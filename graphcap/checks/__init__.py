"""Checks: what a step's inputs must hold, and what a replay must still find where capture left it.

| module | holds |
|---|---|
| `invariants.py` | `check_invariants`: the metadata rules of a staged step, per level |
| `plans.py` | the few-call proofs each level runs first (the rule-by-rule checks only name a failure) |
| `kv_writes.py` | where real tokens write each KV-cache group |
| `statics.py` | `reach`: the tensors a model reaches, each with its slot |
| `guard.py` | `StaticGuard`: static inputs recorded at capture and checked around every replay |
| `sampling.py` | `StepSampler`: every Nth replayed step compared with an eager run (`checks.sample_every`) |
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphcap.checks.guard import StaticGuard
    from graphcap.checks.invariants import check_invariants

__all__ = ["StaticGuard", "check_invariants"]

_EXPORTS = {"StaticGuard": "graphcap.checks.guard", "check_invariants": "graphcap.checks.invariants"}


def __getattr__(name: str) -> Any:
    """Load on first use: the invariants are numpy alone (`graphcap inspect` runs them without torch)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphcap.checks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
