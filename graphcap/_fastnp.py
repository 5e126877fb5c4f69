"""Numpy helpers for the per-step host path, kept apart so domain modules read as domain code.

The budget: staging plus the basic invariants of a 256-request decode step costs tens of
microseconds on the host (`tools/bench_stage.py`, recorded in docs/BENCHMARKS.md), and at
that size the cost is numpy *calls*, about 1 us each, not elements. Each helper here replaces
two or more calls by one. Do not inline them back into `batch.py`, `buffers.py` or
`invariants.py`: measure first.
"""

from __future__ import annotations

import numpy as np

__all__ = ["INT32_MAX", "amax", "amin", "copy_into", "is_filled", "is_ramp", "unsigned_max"]

INT32_MAX = int(np.iinfo(np.int32).max)

# The ufunc reductions themselves: `array.min()` adds a Python-level wrapper per call.
amin, amax = np.minimum.reduce, np.maximum.reduce

_UNSIGNED = {np.dtype(f"i{size}"): np.dtype(f"u{size}") for size in (1, 2, 4, 8)}
# int32 bytes of `[v, v, ...]` and `[0, q, 2q, ...]`, grown on demand: comparing an array
# with one is a single exact memcmp, cheaper than any two numpy reductions.
_FILLS: dict[tuple[int, np.dtype], bytes] = {}
_RAMPS: dict[int, bytes] = {}


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` through a ufunc loop instead of memcpy above 2 KiB.

    Above 2 KiB glibc's memcpy uses `rep movsb`, which on some x86 CPUs (AMD Zen 3, glibc
    2.36) runs 10x slower when `dst` lies 1-63 bytes after `src` modulo 4 KiB. Where the
    scheduler's arrays sit decides that, so plain assignment made staging slow for some
    allocations only (a 64 KB block table: 2 us or 25 us). The ufunc costs the same at any
    offset. Values must already be range-checked: the cast to `dst`'s dtype is unchecked.
    """
    if src.nbytes > 2048:
        np.positive(src, out=dst)
    else:
        dst[...] = src


def is_filled(array: np.ndarray, value: int) -> bool:
    """Every entry of an integer array equals `value` (one memcmp)."""
    key = (value, array.dtype)
    fill = _FILLS.get(key)
    if fill is None or len(fill) < array.nbytes:
        fill = _FILLS[key] = np.full(max(array.size, 1024), value, dtype=array.dtype).tobytes()
    return fill.startswith(array.tobytes())


def is_ramp(array: np.ndarray, step: int) -> bool:
    """`array == step * arange(len(array))` exactly, for an int32 array (one memcmp)."""
    ramp = _RAMPS.get(step)
    if ramp is None or len(ramp) < array.nbytes:
        ramp = _RAMPS[step] = (step * np.arange(max(len(array), 1024), dtype=np.int32)).tobytes()
    return array.dtype == np.int32 and ramp.startswith(array.tobytes())


def unsigned_max(array: np.ndarray) -> int:
    """Largest entry with negatives read as unsigned (so they exceed every int32); -1 when empty.

    One reduction finds negatives and values above int32 together.
    """
    if not array.size:
        return -1
    unsigned = _UNSIGNED.get(array.dtype)
    if unsigned is None and array.dtype.kind == "i":  # not native byte order
        array, unsigned = array.astype(np.int64), _UNSIGNED[np.dtype(np.int64)]
    if array.ndim > 1:
        array = array.ravel()  # a view when contiguous; a 1-D reduction is the cheapest
    return int(amax(array if unsigned is None else array.view(unsigned)))
