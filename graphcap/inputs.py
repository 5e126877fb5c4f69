"""What a model's forward sees (`ForwardInputs`), and the one table of the staged buffers.

`FIELD_TABLE` lists every built-in static input once: its name, what its rows are, its
trailing shape, its dtype and its pad rule. `PersistentBuffers` (buffers.py) lays out the
packed buffer, builds the host and device views, poisons and uploads from this table, and
an engine's own buffers (`BufferSpec`) extend it: a new field costs one row.

`PersistentBuffers.stage` makes `ForwardInputs`; `check_invariants` and models read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from graphcap.batch import GraphKey
from graphcap.config import PadRules
from graphcap.config.buffers import BUFFER_DTYPES, buffer_problems

__all__ = [
    "BUFFER_DTYPES",
    "FIELDS",
    "FIELD_TABLE",
    "BufferSpec",
    "Field",
    "ForwardInputs",
    "HostView",
    "StagingLimits",
]

Rows = Literal["tokens", "reqs", "reqs+1", "none"]


class Field(NamedTuple):
    """One built-in static input: a row of `FIELD_TABLE`."""

    name: str
    rows: Rows
    """`tokens`: one row per padded token (T); `reqs`: per padded request (R); `reqs+1`: R + 1."""
    width: str | None
    """Trailing dimension: None (1-D), or `blocks` (`max_blocks_per_req` columns)."""
    pad: str
    """The `PadRules` field that fills its padded rows."""
    why: str
    """Why the padded rows hold that value."""


FIELD_TABLE: tuple[Field, ...] = (
    Field("query_start_loc", "reqs+1", None, "query_len", "padded requests add padding.query_len tokens (0: none)"),
    Field("seq_lens", "reqs", None, "seq_len", "padded requests attend to padding.seq_len keys"),
    Field("input_ids", "tokens", None, "token_id", "a valid token id"),
    Field("positions", "tokens", None, "position", "any index computed from it stays in range"),
    Field("slot_mapping", "tokens", None, "slot", "negative: padded tokens never write the KV cache"),
    Field("block_table", "reqs", "blocks", "block_id", "the null block, a valid index"),
)
"""Every built-in static input, in packed-buffer order (the block table last, so one upload of
a prefix covers a key's rows). All int32."""

FIELDS = tuple(f.name for f in FIELD_TABLE)
"""The built-in static input names, in packed-buffer order."""


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """An engine-declared persistent buffer, staged, padded, checked and uploaded like the built-ins.

    `rows`: `tokens` (one row per padded token), `reqs` (one per padded request) or `none`
    (a fixed-shape tensor given whole every step). `shape`: the trailing dims. `row_dim`:
    where the row axis sits among the dims (0: first; mrope positions `[3, T]` use
    `shape=(3,), row_dim=1`). `pad` fills padded rows (and the whole tensor of a `none`
    buffer a step does not give). `check(host_view, num_real_rows)` runs at the configured
    invariant level (`basic` and `full`) on the staged host rows and raises to refuse them.
    `sample(rng, num_real_rows)`: the real rows of the batches graphcap makes for capture and
    verification (a numpy `Generator`; `num_real_rows` is 0 for a `none` buffer, which returns
    the whole tensor), so verification runs the buffer with real values, not only its pad.
    Without it those batches hold the pad in every row. Values that index engine state (a
    second KV group's slots, a state row) must name rows the engine lets graphcap write: the
    capture pass writes what the model writes for them.
    """

    name: str
    rows: Literal["tokens", "reqs", "none"]
    shape: tuple[int, ...] = ()
    dtype: str = "int32"
    pad: int | float | bool = 0
    row_dim: int = 0
    check: Callable[[np.ndarray, int], Any] | None = field(default=None, compare=False)
    sample: Callable[[np.random.Generator, int], Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        problems = buffer_problems(self.name, self.rows, self.shape, self.dtype, self.pad, self.row_dim)
        if self.check is not None and not callable(self.check):
            problems.append(("check", f"must be callable(host_view, num_real_rows); got {type(self.check).__name__}"))
        if self.sample is not None and not callable(self.sample):
            problems.append(("sample", f"must be callable(rng, num_real_rows); got {type(self.sample).__name__}"))
        if problems:
            detail = "; ".join(f"{key}: {message}" for key, message in problems)
            raise ValueError(f"BufferSpec {self.name!r}: {detail}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)


class HostView(NamedTuple):
    """Numpy views of the staged rows on the host (the rows `ForwardInputs` exposes)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R+1]
    seq_lens: np.ndarray  # [R]
    block_table: np.ndarray  # [R, B]
    extras: Mapping[str, np.ndarray] = MappingProxyType({})
    """Engine buffers (`BufferSpec`) by name, padded rows included."""


@dataclass(frozen=True, slots=True)
class StagingLimits:
    """Bounds the staged values must respect (None: unknown, not checked)."""

    block_size: int
    max_blocks_per_req: int
    num_blocks: int | None
    vocab_size: int | None
    max_model_len: int | None
    pad: PadRules
    extras: tuple[BufferSpec, ...] = ()
    """The engine's buffers: their pad values and checks."""

    @property
    def num_slots(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size


@dataclass(slots=True)
class ForwardInputs:
    """What `model.forward` receives: views of the persistent tensors for one key.

    Tensor rows cover the padded shape (`T = key.num_tokens`, `R = key.num_reqs`); only the
    first `num_tokens` tokens and `num_reqs` requests are real. Padded tokens after
    `query_start_loc[num_reqs]` belong to no real request: a forward must give them a sink
    and never slice by the Python counts (a graph freezes them). The views alias persistent
    storage: they stay valid, and keep their addresses, for the life of the buffers, and
    the next `stage` overwrites them. A model must not resize or replace them.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32, PAD_SLOT_ID for tokens that must not write the cache
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [R] int32, total lengths including this step
    block_table: torch.Tensor  # [R, max_blocks_per_req] int32
    num_tokens: int
    num_reqs: int
    key: GraphKey
    host: HostView
    limits: StagingLimits
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Engine buffers (`BufferSpec`) by name: views of their padded rows."""
    _basic: Any = field(default=None, init=False, repr=False, compare=False)
    """Cached by `check_invariants`: the views and expected bytes of this step's basic rules."""
    _broken: Callable[[], None] | None = field(default=None, init=False, repr=False, compare=False)
    """Set by staging: `check_invariants` calls it when it finds the rows broken, so the buffers
    rewrite every padded row at the next step instead of trusting what they last wrote."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The static input tensors by name (built-ins in packed order, then the extras)."""
        out = {name: getattr(self, name) for name in FIELDS}
        out.update(self.extras)
        return out
