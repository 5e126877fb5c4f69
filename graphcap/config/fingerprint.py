"""A config's fingerprint: one hash of every key that must agree across data-parallel ranks.

Ranks must plan the same graph keys, pad the same way and check the same invariants, so
their configs must agree on every key except the few that are per rank by nature:
`device` (`cuda:0` on one rank, `cuda:1` on the next) and `report.path` (each rank writes
its own report). `flat_config` gives each key's canonical value, so a mismatch can be
named key by key; `config_fingerprint` hashes them all (reports carry it too).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["PER_RANK_KEYS", "compared_items", "config_fingerprint", "fingerprint_int", "flat_config"]

PER_RANK_KEYS = frozenset({"device", "report.path"})
"""Keys that may differ between data-parallel ranks (left out of the fingerprint)."""


def flat_config(config: Any) -> dict[str, str]:
    """Dotted key -> the value as canonical JSON text, for a `CaptureConfig` or its `to_dict()`."""
    data = config if isinstance(config, dict) else config.to_dict()
    flat: dict[str, str] = {}
    for name, value in data.items():
        if isinstance(value, dict):
            for key, inner in value.items():
                flat[f"{name}.{key}"] = json.dumps(inner, sort_keys=True, default=str)
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def compared_items(config: Any) -> dict[str, str]:
    """`flat_config` without `PER_RANK_KEYS`: what the fingerprint covers, key by key."""
    return {k: v for k, v in flat_config(config).items() if k not in PER_RANK_KEYS}


def config_fingerprint(config: Any) -> str:
    """16 hex digits of SHA-256 over every key but `PER_RANK_KEYS`: equal configs, equal fingerprints."""
    return _digest(config).hex()[:16]


def fingerprint_int(config: Any) -> int:
    """The fingerprint as a non-negative int below 2**62 (fits an int64 all-reduce, negated too)."""
    return int.from_bytes(_digest(config)[:8], "big") >> 2


def _digest(config: Any) -> bytes:
    items = sorted(compared_items(config).items())
    return hashlib.sha256(json.dumps(items).encode()).digest()
