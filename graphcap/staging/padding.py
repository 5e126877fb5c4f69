"""`PadWriter`: the padded rows of the built-in fields, written from the pad rules, only where a step dirtied them.

A step writes its real rows; the rows between them and the key's padded counts must hold the
pad rule (`graphcap.fields.FIELD_TABLE` names each field's rule). Rewriting every padded row
every step costs what the step itself costs when keys are large (a 2304-token mixed key with
1024 request rows zero-filled 768 block-table rows each step), so each region keeps a bound:
rows at or above it hold the pad rule, rows below may not. A step rewrites only
`[real, min(padded, bound))`, then moves the bound.

The bounds trust that nothing but staging writes the buffers. Poisoning moves them to the
maxima (everything is garbage), and so does a failed invariant check (`forget`): whatever
wrote a row, the next step rewrites every padded row again.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from graphcap.config import PadRules
from graphcap.fields import TOKEN_FIELDS

__all__ = ["PadWriter"]


class PadWriter:
    """Writes padded rows of the built-in fields and keeps the bounds of the rows that may be dirty.

    `tokens`, `reqs`: rows of the token fields and of `seq_lens` at or above these hold their
    pad. `table_rows`, `table_cols`: block-table rows at or above `table_rows` hold the pad
    block in their first `table_cols` columns (the columns a fresh table may have written).
    `qsl_written`: the decode plan whose `query_start_loc` rows and step counts are staged (the
    decode pass writes them only when another plan wrote last).
    """

    def __init__(self, host: Mapping[str, np.ndarray], pad: PadRules, max_num_tokens: int, max_num_reqs: int) -> None:
        self.pad = pad
        self._max_tokens, self._max_reqs = max_num_tokens, max_num_reqs
        self._tokens = tuple((host[f.name], getattr(pad, f.pad)) for f in TOKEN_FIELDS)
        self._seq, self._table, self._qsl = host["seq_lens"], host["block_table"], host["query_start_loc"]
        self._steps = np.arange(1, max_num_reqs + 1, dtype=np.int64)
        self.qsl_written: object | None = None  # the plan that wrote the staged query_start_loc rows
        # At first every row is dirty: the zeroed buffers get every pad once.
        self.tokens, self.reqs = max_num_tokens, max_num_reqs
        self.table_rows, self.table_cols = max_num_reqs, self._table.shape[1]
        T, R = max_num_tokens, max_num_reqs
        self._qsl[1:] = self.qsl_tail(T, R, 0, 0)
        self.fill(T, R, 0, 0, 0)

    def clean(self, rows: int, table_cols: int | None = None) -> None:
        """Rows at or above `rows` hold their pad (a step wrote none of them): only the bounds move.
        With `table_cols` (a fresh table of that width staged the real rows), the block table's too."""
        self.tokens = self.reqs = rows
        if table_cols is not None:
            self.table_rows, self.table_cols = rows, table_cols

    def mark_qsl(self, plan: object | None) -> None:
        """`plan` wrote the staged `query_start_loc` rows (None: another pass did, or a bound changed)."""
        self.qsl_written = plan

    def qsl_tail(self, T: int, R: int, n: int, r: int) -> np.ndarray:
        """Padded `query_start_loc[r+1 : R+1]`: each padded request adds `padding.query_len` tokens, capped at T."""
        step = self.pad.query_len
        if step == 0 or n == T:
            return np.full(R - r, n, dtype=np.int32)
        return np.minimum(n + step * self._steps[: R - r], T).astype(np.int32)

    def fill(self, T: int, R: int, n: int, r: int, table_width: int | None) -> None:
        """Write the padded rows `[real : padded]` of the built-ins (the only place), where dirty.

        `table_width`: columns of a fresh table the step staged into rows `[0, r)` (the null
        block: all of them), whose padded rows are then ours to fill; None for a persistent
        table, which keeps rows outside a step empty itself. (`query_start_loc`'s tail is
        written with its real rows.)
        """
        dirty = self.tokens
        if n < T and dirty > n:
            hi = min(T, dirty)
            for host, value in self._tokens:
                host[n:hi] = value
        self.tokens = n if dirty <= T else dirty
        dirty = self.reqs
        if r < R and dirty > r:
            self._seq[r : min(R, dirty)] = self.pad.seq_len
        self.reqs = r if dirty <= R else dirty
        if table_width is not None:
            dirty, cols = self.table_rows, self.table_cols
            if r < R and dirty > r and cols:
                self._table[r : min(R, dirty), :cols] = self.pad.block_id
            # Rows [0, r) hold `table_width` real columns; rows past R keep what they held.
            self.table_rows = r if dirty <= R else dirty
            self.table_cols = max(table_width, cols) if dirty > R else table_width

    def claim_table_rows(self) -> None:
        """Before the persistent table's rows are used: clear what fresh-table steps left in them."""
        rows = self.table_rows
        if rows:
            self._table[:rows, : self.table_cols] = self.pad.block_id
            self.table_rows = self.table_cols = 0

    def forget(self, kept_table: bool) -> None:
        """Trust no padded row (after poisoning, or a check that found staged rows broken).

        `kept_table`: the persistent block table's rows hold real blocks and stay trusted.
        """
        self.tokens, self.reqs = self._max_tokens, self._max_reqs
        if not kept_table:
            self.table_rows, self.table_cols = self._max_reqs, self._table.shape[1]
        self.qsl_written = None
