"""Padded rows of the built-in buffers: written from the pad rules, and only where a step dirtied them.

A step writes its real rows; the rows between them and the key's padded counts must hold the
pad rule. Rewriting every padded row every step costs what the step itself costs when keys
are large (a 2304-token mixed key with 1024 request rows zero-filled 768 block-table rows
each step), so each region keeps a bound: rows at or above it hold the pad rule, rows below
may not. A step rewrites only `[real, min(padded, bound))`, then moves the bound.

The bounds trust that nothing but staging writes the buffers. Poisoning moves them to the
maxima (everything is garbage), and so does a failed invariant check (`ForwardInputs._broken`):
whatever wrote a row, the next step rewrites every padded row again.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PaddedRows"]


class PaddedRows:
    """The padded-row writer and its bounds; a mixin of `PersistentBuffers` (via `Staging`)."""

    def _init_padding(self) -> None:
        T, R, B = self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req
        self._qsl_written = None  # the decode plan whose query_start_loc rows are staged
        # Rows below these bounds may differ from the pad rule; rows at or above hold it.
        # At first every row is dirty: the zeroed buffers get every pad once.
        self._dirty_tokens, self._dirty_reqs, self._dirty_table_rows, self._dirty_table_cols = T, R, R, B
        self._h_qsl[1:] = self._qsl_tail(T, R, 0, 0)
        self._table_width: int | None = 0  # see _fill_padding
        self._fill_padding(T, R, 0, 0)

    def _qsl_tail(self, T: int, R: int, n: int, r: int) -> np.ndarray:
        """Padded `query_start_loc[r+1 : R+1]`: each padded request adds `padding.query_len` tokens, capped at T."""
        step = self.limits.pad.query_len
        if step == 0 or n == T:
            return np.full(R - r, n, dtype=np.int32)
        return np.minimum(n + step * self._arange[1 : R - r + 1].astype(np.int64), T).astype(np.int32)

    def _fill_padding(self, T: int, R: int, n: int, r: int) -> None:
        """Write the padded rows `[real : padded]` of the built-ins from the pad rules (the only place).

        Only rows an earlier step dirtied are rewritten. `self._table_width`: columns of a fresh
        table the step staged into rows `[0, r)` (the null block: all of them), whose padded
        rows are then ours to fill; None for a persistent table, which keeps rows outside a
        step empty itself. (`query_start_loc`'s tail is written with its real rows.)
        """
        table_width = self._table_width
        pad = self.limits.pad
        dirty = self._dirty_tokens
        if n < T and dirty > n:
            hi = min(T, dirty)
            self._h_ids[n:hi] = pad.token_id
            self._h_pos[n:hi] = pad.position
            self._h_slot[n:hi] = pad.slot
        self._dirty_tokens = n if dirty <= T else dirty
        dirty = self._dirty_reqs
        if r < R and dirty > r:
            self._h_seq[r : min(R, dirty)] = pad.seq_len
        self._dirty_reqs = r if dirty <= R else dirty
        if table_width is not None:
            dirty, cols = self._dirty_table_rows, self._dirty_table_cols
            if r < R and dirty > r and cols:
                self._h_bt[r : min(R, dirty), :cols] = pad.block_id
            # Rows [0, r) hold `table_width` real columns; rows past R keep what they held.
            self._dirty_table_rows = r if dirty <= R else dirty
            self._dirty_table_cols = max(table_width, cols) if dirty > R else table_width

    def _claim_table_rows(self) -> None:
        """Before the persistent table's rows are used: clear what fresh-table steps left in them."""
        rows = self._dirty_table_rows
        if rows:
            self._h_bt[:rows, : self._dirty_table_cols] = self.limits.pad.block_id
            self._dirty_table_rows = self._dirty_table_cols = 0

    def _forget_clean_rows(self) -> None:
        """Trust no padded row: a check found staged rows broken (something wrote the buffers)."""
        self._poisoned(kept_table=self.block_table.top > 0)

    def _poisoned(self, kept_table: bool) -> None:
        self._dirty_tokens, self._dirty_reqs = self.max_num_tokens, self.max_num_reqs
        if not kept_table:
            self._dirty_table_rows, self._dirty_table_cols = self.max_num_reqs, self.max_blocks_per_req
        self._qsl_written = None
