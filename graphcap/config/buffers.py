"""The `buffers:` section: engine-declared persistent buffers, and the rules every declaration keeps.

The rules (`buffer_problems`) are shared by the YAML section (`BufferConfig`) and the Python
declaration (`graphcap.BufferSpec`), so a buffer is valid in both or in neither. Written
without torch or numpy, so that loading a config stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from graphcap.config._schema import Section, problem, spec
from graphcap.errors import ConfigProblem
from graphcap.fields import RESERVED_NAMES

__all__ = ["BUFFER_DTYPES", "BUILTIN_FIELDS", "BufferConfig", "buffer_problems"]

BUFFER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64", "bool")
"""Dtypes an engine buffer may have (numpy and torch both hold them; numpy has no bfloat16)."""

BUILTIN_FIELDS = RESERVED_NAMES
"""Names of the built-in static inputs (`graphcap.fields.FIELD_TABLE`, the step's counts): not free for a buffer."""

_INT_RANGES = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
}
_FLOAT_MAX = {"float16": 65504.0, "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}
_MAX_DIM = 1 << 20


def buffer_problems(name: Any, rows: Any, shape: Any, dtype: Any, pad: Any, row_dim: Any) -> list[tuple[str, str]]:
    """`(field, message)` for every problem of one buffer declaration."""
    out: list[tuple[str, str]] = []
    if not isinstance(name, str) or not name.isidentifier():
        out.append(("name", f"must be a Python identifier (it names ForwardInputs.extras[...]); got {name!r}"))
    elif name in BUILTIN_FIELDS:
        out.append(("name", f"{name!r} is a built-in field; pick another name"))
    if rows not in ("tokens", "reqs", "none"):
        out.append(("rows", f"must be tokens, reqs or none; got {rows!r}"))
    dims_ok = (
        isinstance(shape, (tuple, list))
        and len(shape) <= 4
        and all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= _MAX_DIM for d in shape)
    )
    if not dims_ok:
        out.append(("shape", f"must be a list of up to 4 dimensions in 1..{_MAX_DIM}; got {shape!r}"))
    if dtype not in BUFFER_DTYPES:
        out.append(("dtype", f"must be one of {', '.join(BUFFER_DTYPES)}; got {dtype!r}"))
    elif not _pad_fits(pad, dtype):
        out.append(("pad", f"{pad!r} is not a value of dtype {dtype}"))
    max_dim = len(shape) if dims_ok and rows in ("tokens", "reqs") else 0
    if isinstance(row_dim, bool) or not isinstance(row_dim, int) or not 0 <= row_dim <= max_dim:
        out.append(("row_dim", f"must be an integer in 0..{max_dim} (where the row axis sits); got {row_dim!r}"))
    return out


def _pad_fits(pad: Any, dtype: str) -> bool:
    if dtype == "bool":
        return isinstance(pad, bool) or (isinstance(pad, int) and pad in (0, 1))
    if isinstance(pad, bool) or not isinstance(pad, (int, float)):
        return False
    if dtype in _INT_RANGES:
        low, high = _INT_RANGES[dtype]
        return (isinstance(pad, int) or pad.is_integer()) and low <= pad <= high
    return not math.isnan(pad) and (math.isinf(pad) or abs(pad) <= _FLOAT_MAX[dtype])


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferConfig(Section):
    """One entry of the `buffers:` list (the same keys as `graphcap.BufferSpec`, without `check`)."""

    _key: ClassVar[str] = "buffers[]"
    name: str = ""
    """Names `ForwardInputs.extras[name]` and `StepBatch(extras={name: ...})`."""
    rows: Literal["tokens", "reqs", "none"] = "tokens"
    """`tokens`: a row per padded token; `reqs`: per padded request; `none`: a fixed-shape tensor."""
    shape: tuple[int, ...] = ()
    """Trailing dimensions (besides the rows)."""
    dtype: Literal[BUFFER_DTYPES] = "int32"  # type: ignore[valid-type]
    """Element type."""
    pad: bool | int | float = spec(0)
    """Fills padded rows (the whole tensor of a `none` buffer a step does not give)."""
    row_dim: int = 0
    """Where the row axis sits among the dims (mrope positions `[3, T]`: shape [3], row_dim 1)."""

    def _check(self) -> list[ConfigProblem]:
        return [problem(key, message) for key, message in buffer_problems(*self.as_tuple())]

    def as_tuple(self) -> tuple:
        return (self.name, self.rows, self.shape, self.dtype, self.pad, self.row_dim)
