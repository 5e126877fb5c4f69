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

__all__ = [
    "BUFFER_DTYPES",
    "BUFFER_ROWS",
    "BUILTIN_FIELDS",
    "BufferConfig",
    "buffer_problems",
    "cumulative_step",
    "cumulative_tail",
    "real_rows",
]

BUFFER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64", "bool")
"""Dtypes an engine buffer may have (numpy and torch both hold them; numpy has no bfloat16)."""

BUFFER_ROWS = ("tokens", "reqs", "reqs+1", "none")
"""What a buffer's rows are: a row per padded token (T), per padded request (R), a cumulative entry per
padded request and a leading 0 (R + 1: `query_start_loc`'s shape), or none (a fixed-shape tensor)."""

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


def buffer_problems(
    name: Any, rows: Any, shape: Any, dtype: Any, pad: Any, row_dim: Any, domain: Any = None
) -> list[tuple[str, str]]:
    """`(field, message)` for every problem of one buffer declaration."""
    out: list[tuple[str, str]] = []
    if not isinstance(name, str) or not name.isidentifier():
        out.append(("name", f"must be a Python identifier (it names ForwardInputs.extras[...]); got {name!r}"))
    elif name in BUILTIN_FIELDS:
        out.append(("name", f"{name!r} is a built-in field; pick another name"))
    if rows not in BUFFER_ROWS:
        out.append(("rows", f"must be tokens, reqs, reqs+1 or none; got {rows!r}"))
    dims_ok = (
        isinstance(shape, (tuple, list))
        and len(shape) <= 4
        and all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= _MAX_DIM for d in shape)
    )
    if not dims_ok:
        out.append(("shape", f"must be a list of up to 4 dimensions in 1..{_MAX_DIM}; got {shape!r}"))
    if dtype not in BUFFER_DTYPES:
        out.append(("dtype", f"must be one of {', '.join(BUFFER_DTYPES)}; got {dtype!r}"))
    elif rows == "reqs+1":
        out += _cumulative_problems(shape, dtype, pad)
    elif not _pad_fits(pad, dtype):
        quoted = isinstance(pad, str) and pad.strip().lstrip("+-").replace(".", "", 1).isdigit()
        out.append(
            ("pad", f"{pad!r} is not a value of dtype {dtype}" + (" (a quoted number: drop the quotes)" * quoted))
        )
    max_dim = len(shape) if dims_ok and rows in ("tokens", "reqs") else 0
    if isinstance(row_dim, bool) or not isinstance(row_dim, int) or not 0 <= row_dim <= max_dim:
        out.append(("row_dim", f"must be an integer in 0..{max_dim} (where the row axis sits); got {row_dim!r}"))
    if domain is not None:
        out += _domain_problems(domain, dtype, pad)
    return out


def cumulative_step(pad: int | str) -> int:
    """What each padded entry of a `reqs+1` buffer adds to the one before it: its `pad` (`"last"`: 0)."""
    return 0 if pad == "last" else int(pad)


def _cumulative_problems(shape: Any, dtype: str, pad: Any) -> list[tuple[str, str]]:
    out = []
    if dtype not in _INT_RANGES:
        why = "a reqs+1 buffer is cumulative (offsets, like query_start_loc): an integer dtype"
        out.append(("dtype", f"{why}; got {dtype}"))
    if shape not in ((), []):
        out.append(("shape", f"a reqs+1 buffer is one entry per request and one more: shape []; got {list(shape)}"))
    step_ok = pad == "last" or (isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0)
    if not step_ok or (pad != "last" and dtype in _INT_RANGES and pad > _INT_RANGES[dtype][1]):
        out.append(
            (
                "pad",
                f"a reqs+1 buffer's pad is 'last' (padded entries repeat the last real one) or the integer "
                f">= 0 each padded entry adds (query_start_loc's padding.query_len rule); got {pad!r}",
            )
        )
    return out


def _domain_problems(domain: Any, dtype: Any, pad: Any) -> list[tuple[str, str]]:
    ok = (
        isinstance(domain, (tuple, list))
        and len(domain) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in domain)
        and domain[0] < domain[1]
    )
    if not ok:
        return [("domain", f"must be [low, high], two finite numbers with low < high; got {domain!r}")]
    if dtype in BUFFER_DTYPES and not dtype.startswith("float"):
        return [("domain", f"bounds the values graphcap samples for a float buffer; {dtype} is not one")]
    low, high = domain
    if dtype in _FLOAT_MAX and max(abs(low), abs(high)) > _FLOAT_MAX[dtype]:
        return [("domain", f"{list(domain)} holds values {dtype} cannot store (its largest is {_FLOAT_MAX[dtype]:g})")]
    if isinstance(pad, (int, float)) and not isinstance(pad, bool) and not low <= pad <= high:
        return [("pad", f"{pad!r} lies outside the buffer's domain {list(domain)}: padded rows hold a value of it")]
    return []


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
    rows: Literal[BUFFER_ROWS] = "tokens"  # type: ignore[valid-type]
    """`tokens`: a row per padded token; `reqs`: per padded request; `reqs+1`: a cumulative array of offsets
    (`cu_seqlens_k`, `paged_kv_indptr`), an entry per padded request and a leading 0; `none`: a fixed-shape tensor."""
    shape: tuple[int, ...] = ()
    """Trailing dimensions (besides the rows)."""
    dtype: Literal[BUFFER_DTYPES] = "int32"  # type: ignore[valid-type]
    """Element type."""
    pad: bool | int | float | str = spec(0)
    """Fills padded rows (the whole tensor of a `none` buffer a step does not give). A `reqs+1` buffer:
    what each padded entry adds to the one before (`last` or 0: the last real entry repeated)."""
    row_dim: int = 0
    """Where the row axis sits among the dims (mrope positions `[3, T]`: shape [3], row_dim 1)."""
    domain: tuple[float, ...] | None = None
    """`[low, high]`: the values a float buffer may hold (a probability: [0, 1]); graphcap samples within it."""

    def _check(self) -> list[ConfigProblem]:
        return [problem(key, message) for key, message in buffer_problems(*self.as_tuple())]

    def as_tuple(self) -> tuple:
        return (self.name, self.rows, self.shape, self.dtype, self.pad, self.row_dim, self.domain)


def cumulative_tail(spec: Any, last: int, num_padded: int) -> Any:
    """The padded entries of a `reqs+1` buffer after the real entry `last`: `last + pad * (1, 2, ...)`."""
    import numpy as np  # here: loading a config (`graphcap validate`) imports neither numpy nor torch

    return last + cumulative_step(spec.pad) * np.arange(1, num_padded + 1, dtype=np.int64)


def real_rows(spec: Any, num_tokens: int, num_reqs: int) -> int | None:
    """The real rows of `spec` in a step of these counts (a `reqs+1` buffer: `num_reqs + 1`; `none`: None)."""
    return {"tokens": num_tokens, "reqs": num_reqs, "reqs+1": num_reqs + 1, "none": None}[spec.rows]
