"""Numpy helpers for the per-step host path, kept apart so domain modules read as domain code.

The budget: `StepBatch` + staging + the basic invariants of a 256-request decode step cost
about 5 us on the host with the persistent block table (`tools/bench_stage.py --compare`,
recorded in docs/BENCHMARKS.md), and at that size the cost is numpy *calls* (0.1-0.7 us
each on a 2-core EPYC VM; reductions are the dear ones), not elements. Each helper here
saves calls or call overhead. Measure before inlining or replacing one.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ONES_BYTES", "amax", "amin", "filled", "ones", "unsigned_max"]

# The ufunc reductions themselves: `array.min()` adds a Python-level wrapper per call.
amin, amax = np.minimum.reduce, np.maximum.reduce

_UNSIGNED = {np.dtype(f"i{size}"): np.dtype(f"u{size}") for size in (1, 2, 4, 8)}
# Read-only constant operands, grown on demand. A ufunc given a cached array runs ~0.25 us
# faster than given a Python int (which it converts to a 0-d array on every call).
_CONSTANTS: dict[tuple[int, np.dtype | type], np.ndarray] = {}
_INT32 = np.dtype(np.int32)
_MAX_CONSTANTS = 256


def filled(value: int, size: int, dtype: np.dtype | type = _INT32) -> np.ndarray:
    """A read-only array of `size` entries all equal to `value` (shared, grown on demand).

    Pass `dtype` as an `np.dtype` on hot paths (a type is normalized once per call).
    """
    key = (value, dtype)
    array = _CONSTANTS.get(key)
    if array is None or len(array) < size:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.pop(next(iter(_CONSTANTS)))
        if not isinstance(dtype, np.dtype):
            return filled(value, size, np.dtype(dtype))
        array = np.full(max(size, 1024, 0 if array is None else 2 * len(array)), value, dtype=dtype)
        array.flags.writeable = False
        _CONSTANTS[key] = array
    return array[:size]


_ONES = filled(1, 4096)
ONES_BYTES = _ONES.tobytes()
"""The bytes of 4096 int32 ones: `ONES_BYTES.startswith(q.tobytes())` is "q is all ones" in one memcmp."""


def ones(size: int) -> np.ndarray:
    """A read-only int32 array of `size` ones (a decode step's `query_lens`), shared."""
    return _ONES[:size] if size <= len(_ONES) else filled(1, size)


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
