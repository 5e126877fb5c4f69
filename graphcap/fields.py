"""The built-in static inputs, once: `FIELD_TABLE` (name, rows, width, pad rule, why), and their int32 range.

Every list of the built-in fields elsewhere derives from this table: the packed layout and the
views of `PersistentBuffers`, the pad writer, `HostView` and `ForwardInputs` (built by keyword
from it), the names an engine buffer may not take, and the request-row fields piecewise graphs
may not read. Imports nothing (the config package reads it without numpy or torch).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = [
    "COUNTS_ENTRY",
    "COUNT_FIELDS",
    "FIELDS",
    "FIELD_TABLE",
    "INT32_MAX",
    "INT32_MIN",
    "RESERVED_NAMES",
    "REQUEST_FIELDS",
    "TOKEN_FIELDS",
    "Field",
    "Rows",
]

INT32_MAX = 2**31 - 1
"""Largest value the int32 staging buffers hold (ids, lengths, slots, offsets)."""
INT32_MIN = -(2**31)

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
a prefix covers a key's rows). All int32. `query_start_loc`'s padded rows are cumulative (each
padded request adds `padding.query_len` tokens, capped at T), so its writer computes them."""

FIELDS = tuple(f.name for f in FIELD_TABLE)
"""The built-in static input names, in packed-buffer order."""
TOKEN_FIELDS = tuple(f for f in FIELD_TABLE if f.rows == "tokens")
"""The fields with one row per token (padded rows hold their pad rule's value)."""
REQUEST_FIELDS = tuple(f.name for f in FIELD_TABLE if f.rows != "tokens")
"""The fields with one row per request: a piecewise graph, whose request count varies, never reads them."""

COUNT_FIELDS = ("num_tokens_device", "num_reqs_device")
"""The step's real token and request counts as 0-dim int32 device tensors of `ForwardInputs`: what a
graph reads to tell real rows from padded ones (`ForwardInputs.padding_mask`). Staged with the rows on
every step, so a replay reads the current step's counts."""
COUNTS_ENTRY = "step_counts"
"""The packed-buffer entry that holds `COUNT_FIELDS` (two int32, in that order): one write per step."""
RESERVED_NAMES = (*FIELDS, *COUNT_FIELDS, COUNTS_ENTRY)
"""Names of the built-in static inputs and their packed entries: not free for an engine buffer."""
