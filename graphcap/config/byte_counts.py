"""Byte counts: `parse_bytes` reads one written as a number or a size such as `4GiB` (config keys
and CLI flags); `format_bytes` writes one for people (`1536` -> `1.5 KiB`).

One parser for `capture.memory_budget` and `graphcap sizes --memory-budget`, so a size that one
accepts the other accepts too. Imports nothing of graphcap.
"""

from __future__ import annotations

import re

__all__ = ["MAX_BYTES", "format_bytes", "parse_bytes"]

MAX_BYTES = 1 << 62
"""Sizes at or above this are refused (they fit no device and overflow int64 arithmetic)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_BYTES = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """`4GiB` -> 4294967296: bytes, or a number with B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
    (powers of 1024), case-insensitive. `ValueError` saying what is expected otherwise (the caller
    names its key or flag)."""
    match = _BYTES.fullmatch(text) if isinstance(text, str) else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None or not 1 <= float(match.group(1)) * unit < MAX_BYTES:
        raise ValueError(f"expected bytes or a size such as 4GiB, 512MiB or 8GB (at least 1 byte); got {text!r}")
    return int(float(match.group(1)) * unit)


def format_bytes(num: int | float) -> str:
    """`1536` -> `1.5 KiB`: binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"
