"""A config's fingerprint: one hash of every key that must agree across data-parallel ranks.

Ranks must plan the same graph keys, pad the same way and check the same invariants, so
their configs must agree on every key except the few that are per rank by nature:
`device` (`cuda:0` on one rank, `cuda:1` on the next) and `report.path` (each rank writes
its own report). `flat_config` gives each key's canonical value, so a mismatch can be
named key by key; `config_fingerprint` hashes them all (reports carry it too).

Ranks agree on more than the config: `agreed_items` adds the torch and graphcap versions
(`version.torch`, `version.graphcap`), since ranks on different versions may plan, stage or
capture differently; `fingerprint_int` (what ranks all-reduce) covers them.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphcap.config.root import CaptureConfig

__all__ = [
    "PER_RANK_KEYS",
    "agreed_items",
    "compared_items",
    "config_fingerprint",
    "fingerprint_int",
    "flat_config",
    "versions",
]

PER_RANK_KEYS = frozenset({"device", "report.path"})
"""Keys that may differ between data-parallel ranks (left out of the fingerprint)."""


def flat_config(config: CaptureConfig | dict[str, Any]) -> dict[str, str]:
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


def compared_items(config: CaptureConfig | dict[str, Any]) -> dict[str, str]:
    """`flat_config` without `PER_RANK_KEYS`: what the fingerprint covers, key by key."""
    return {k: v for k, v in flat_config(config).items() if k not in PER_RANK_KEYS}


def config_fingerprint(config: CaptureConfig | dict[str, Any]) -> str:
    """16 hex digits of SHA-256 over every key but `PER_RANK_KEYS`: equal configs, equal fingerprints."""
    return _digest(compared_items(config)).hex()[:16]


def versions() -> dict[str, str]:
    """`version.torch` and `version.graphcap`, as the ranks compare them."""
    import torch

    try:
        graphcap_version = version("graphcap")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH that was never installed
        graphcap_version = "0+unknown"
    return {"version.torch": torch.__version__, "version.graphcap": graphcap_version}


def agreed_items(config: CaptureConfig) -> dict[str, str]:
    """What parallel ranks must share, key by key: `compared_items` and the `versions`."""
    return {**compared_items(config), **versions()}


def fingerprint_int(config: CaptureConfig) -> int:
    """The fingerprint of `agreed_items` (versions included) as a non-negative int below 2**62 (an int64)."""
    return int.from_bytes(_digest(agreed_items(config))[:8], "big") >> 2


def _digest(items: dict[str, str]) -> bytes:
    return hashlib.sha256(json.dumps(sorted(items.items())).encode()).digest()
