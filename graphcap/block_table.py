"""`BlockTable`: the persistent block table of an engine that keeps one (as vLLM's `BlockTable`).

An engine that keeps its requests in rows (vLLM's persistent batch) changes a few rows per
step: a new request's blocks, a block appended when a request crosses a block boundary, a
row moved when the batch is condensed. `BlockTable` takes exactly those writes, validates
them when they happen, and a step then names its rows instead of passing a fresh table:
`StepBatch(q, s, ids, block_table=manager.block_table)` reads request i's blocks from row i.
Staging such a step neither copies nor scans the table; it checks, per request, that its
sequence fits the blocks its row holds (one comparison over the requests).

The rows *are* the staged `block_table` buffer, so they are what the graphs read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from graphcap.errors import BatchError
from graphcap.fields import INT32_MAX

__all__ = ["BlockTable"]


class BlockTable:
    """Rows of KV-cache block ids, one per request slot of the engine, kept between steps.

    Row `i` holds `num_blocks(i)` blocks in its first columns and the pad block
    (`padding.block_id`) in every other column; a row without blocks is all pad. Writes
    (`set_row`, `append`, `truncate`, `move`, `swap`, `clear`, `reset`) cost O(blocks written), refuse
    bad rows or block ids with `BatchError` before changing anything, and on CUDA first wait
    for the previous step's upload, which still reads the pinned host rows.

    A step that names the table uses rows `0..num_reqs-1` for its requests, in order, as
    vLLM's persistent batch does: keep the scheduled requests in the first rows (`move`
    condenses, `swap` reorders). Rows between the step's requests and the key's padded
    request count must be empty, because padded requests read the pad block
    (`clear` requests that leave the step, as vLLM removes unscheduled requests).

    Block ids are `1..num_blocks-1`: block 0 is the null block. The table of a KV-cache group
    with a `sliding_window` (`null_ok`) also takes 0, for columns the window has left.

    Made by `PersistentBuffers` (`buffers.block_table`, `CaptureManager.block_table`); not
    thread-safe (writes go under the manager's lock when threads share it).
    """

    def __init__(
        self,
        rows: np.ndarray,
        *,
        block_size: int,
        num_blocks: int | None,
        max_model_len: int | None,
        pad_block: int,
        before_write: Callable[[], None],
        null_ok: bool = False,
    ) -> None:
        self._rows = rows  # [max_num_reqs, max_blocks_per_req] int32: the staged buffer's rows
        num_rows, width = rows.shape
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._pad = pad_block
        self.before_write = before_write
        self._lowest = 0 if null_ok else 1  # a sliding-window group points columns its window left at block 0
        # Tokens a row's blocks can hold, capped at max_model_len: a step's request fits its row
        # when 1 <= seq_len <= capacity, i.e. (seq_len - 1) read as unsigned < capacity.
        self._max_len = INT32_MAX if max_model_len is None else max_model_len
        self.capacity = np.zeros(num_rows, dtype=np.uint32)
        self.counts = np.zeros(num_rows, dtype=np.int32)
        # slot = offsets[row, position // block_size] + position, with offsets[row, j] =
        # (block - j) * block_size: one gather and one add per token on the hot path.
        self.offsets = np.zeros((num_rows, width), dtype=np.int32)
        self.flat_offsets = self.offsets.reshape(-1)
        self._columns = np.arange(width, dtype=np.int64)
        self.top = 0
        """One past the last row that holds blocks (0: the table is empty)."""

    @property
    def num_rows(self) -> int:
        """Rows of the table (`batching.max_num_seqs`)."""
        return int(self._rows.shape[0])

    @property
    def max_blocks_per_row(self) -> int:
        """Columns of a row (`kv_cache.max_model_len / block_size`, rounded up)."""
        return int(self._rows.shape[1])

    def num_blocks(self, row: int) -> int:
        """Blocks row `row` holds."""
        return int(self.counts[self._row(row, "num_blocks")])

    def row(self, row: int) -> np.ndarray:
        """The blocks of row `row` (a read-only view: valid until the row is written)."""
        i = self._row(row, "row")
        view = self._rows[i, : self.counts[i]]
        view.flags.writeable = False
        return view

    def holding(self, block_ids: Iterable[int]) -> tuple[int, int] | None:
        """`(row, block)` of the first row holding one of `block_ids` among its blocks; None when no row does.

        O(blocks held): what an engine's scratch blocks are checked against (a live row's block is not free).
        """
        top = self.top
        if not top:
            return None
        wanted = np.asarray(list(block_ids), dtype=np.int64)
        if not wanted.size:
            return None
        held = self._columns < self.counts[:top, None]  # [top, width]: the columns each row holds
        hit = np.argwhere(held & np.isin(self._rows[:top], wanted))
        if not hit.size:
            return None
        i, j = (int(v) for v in hit[0])
        return i, int(self._rows[i, j])

    # -- writes ------------------------------------------------------------------------------

    def set_row(self, row: int, block_ids: npt.ArrayLike) -> None:
        """Row `row` holds exactly `block_ids` (a new request, or one whose blocks were replaced)."""
        i = self._row(row, "set_row")
        blocks = self._blocks(block_ids, f"set_row(row {row})", 0)
        self.before_write()
        old = int(self.counts[i])
        self._write(i, 0, blocks)
        if old > len(blocks):
            self._rows[i, len(blocks) : old] = self._pad
        self._set_count(i, len(blocks))

    def append(self, row: int, block_ids: npt.ArrayLike) -> None:
        """Row `row` gains `block_ids` after the blocks it holds (a request that grew)."""
        i = self._row(row, "append")
        start = int(self.counts[i])
        blocks = self._blocks(block_ids, f"append(row {row})", start)
        if not len(blocks):
            return
        self.before_write()
        self._write(i, start, blocks)
        self._set_count(i, start + len(blocks))

    def move(self, src: int, dst: int) -> None:
        """Row `dst` takes row `src`'s blocks and `src` becomes empty (condensing the batch).

        Whatever `dst` held is dropped.
        """
        i, j = self._row(src, "move"), self._row(dst, "move")
        if i == j:
            return
        self.before_write()
        n, old = int(self.counts[i]), int(self.counts[j])
        self._rows[j, :n] = self._rows[i, :n]
        self.offsets[j, :n] = self.offsets[i, :n]
        if old > n:
            self._rows[j, n:old] = self._pad
        self._rows[i, :n] = self._pad
        self._set_count(j, n)
        self._set_count(i, 0)

    def swap(self, a: int, b: int) -> None:
        """Rows `a` and `b` exchange their blocks (reordering the batch)."""
        i, j = self._row(a, "swap"), self._row(b, "swap")
        if i == j:
            return
        self.before_write()
        ni, nj = int(self.counts[i]), int(self.counts[j])
        width = max(ni, nj)
        for table in (self._rows, self.offsets):
            saved = table[i, :width].copy()
            table[i, :width] = table[j, :width]
            table[j, :width] = saved
        self._set_count(i, nj)
        self._set_count(j, ni)

    def truncate(self, row: int, num_blocks: int) -> None:
        """Row `row` keeps only its first `num_blocks` blocks (a speculative-decoding rollback, a
        preempted tail); the dropped columns read the pad block. `num_blocks` is an integer in
        `0..num_blocks(row)`: a truncation never adds blocks (`append` does)."""
        i = self._row(row, "truncate")
        held = int(self.counts[i])
        if isinstance(num_blocks, (bool, np.bool_)) or not isinstance(num_blocks, (int, np.integer)):
            raise BatchError(f"block_table.truncate(row {row}): num_blocks must be an integer; got {num_blocks!r}")
        if not 0 <= num_blocks <= held:
            raise BatchError(
                f"block_table.truncate(row {row}): num_blocks {num_blocks} is outside 0..{held} (the blocks the "
                "row holds); truncate keeps a prefix of them: append adds blocks"
            )
        keep = int(num_blocks)
        if keep == held:
            return
        self.before_write()
        self._rows[i, keep:held] = self._pad
        self._set_count(i, keep)

    def clear(self, row: int) -> None:
        """Row `row` holds no blocks (its request finished or left the batch)."""
        i = self._row(row, "clear")
        n = int(self.counts[i])
        if n:
            self.before_write()
            self._rows[i, :n] = self._pad
            self._set_count(i, 0)

    def reset(self) -> None:
        """Every row empty."""
        if self.top:
            self.before_write()
            self._rows[: self.top] = self._pad
            self.counts[: self.top] = 0
            self.capacity[: self.top] = 0
            self.top = 0

    def resize(self, num_blocks: int) -> None:
        """The KV cache now holds `num_blocks` blocks: later writes are checked against the new bound.

        Refuses (`BatchError` naming the row, column and block) when a row holds a block at or past
        a smaller bound, before changing anything: clear or re-write such rows first.
        """
        self.check_resize(num_blocks)
        self._num_blocks = num_blocks

    def check_resize(self, num_blocks: int) -> None:
        """What `resize(num_blocks)` refuses, without changing anything."""
        top = self.top
        if top:
            held = self._columns < self.counts[:top, None]  # [top, width]: the columns each row holds
            bad = np.argwhere(held & (self._rows[:top] >= num_blocks))
            if bad.size:
                i, j = (int(v) for v in bad[0])
                raise BatchError(
                    f"block_table row {i} holds block {int(self._rows[i, j])} (column {j}), outside the resized KV "
                    f"cache [0, {num_blocks}) (kv_cache.num_blocks); clear or set_row every row holding blocks "
                    "past the new bound before resize_kv"
                )

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the rows that hold blocks (for `PersistentBuffers.table_set_aside`)."""
        top = self.top
        return self._rows[:top].copy(), self.offsets[:top].copy(), self.counts[:top].copy()

    def restore(self, saved: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Put back rows from `snapshot` into an empty table (the caller waited for the upload)."""
        rows, offsets, counts = saved
        top = len(counts)
        self._rows[:top] = rows
        self.offsets[:top] = offsets
        self.counts[:top] = counts
        self.capacity[:top] = np.minimum(counts.astype(np.int64) * self._block_size, self._max_len)
        self.top = top

    # -- checks ------------------------------------------------------------------------------

    def check_step(self, seq_lens: np.ndarray, num_reqs: int, padded_reqs: int) -> None:
        """Refuse a step naming rows `0..num_reqs-1` whose sequences do not fit them (`BatchError`).

        Also refuses rows among the key's padded requests (`num_reqs..padded_reqs-1`) that hold
        blocks: padded requests must read the pad block.
        """
        s = np.asarray(seq_lens, dtype=np.int64)
        capacity = self.capacity[:num_reqs].astype(np.int64)
        bad = np.flatnonzero((s < 1) | (s > capacity))
        if bad.size:
            i = int(bad[0])
            if s[i] > self._max_len:
                raise BatchError(
                    f"seq_lens[{i}] is {int(s[i])}, above max_model_len {self._max_len} "
                    "(kv_cache.max_model_len); finish or truncate the request"
                )
            if s[i] >= 1:
                need = -(-int(s[i]) // self._block_size)
                raise BatchError(
                    f"request {i} has seq_len {int(s[i])}, which needs {need} blocks of {self._block_size}, "
                    f"but row {i} of the block table holds {int(self.counts[i])} (append its new blocks first)"
                )
            raise BatchError(f"seq_lens[{i}] is {int(s[i])}; a scheduled request has seq_len >= 1")
        live = np.flatnonzero(self.counts[num_reqs:padded_reqs])
        if live.size:
            row = num_reqs + int(live[0])
            raise BatchError(
                f"row {row} of the block table holds {int(self.counts[row])} blocks but the step has {num_reqs} "
                f"requests and its key pads to {padded_reqs}: padded requests read rows {num_reqs}.."
                f"{padded_reqs - 1}, which must be empty; move the step's requests to rows 0..{num_reqs - 1} "
                "and clear rows that are not in the step"
            )

    # -- internals ---------------------------------------------------------------------------

    def _row(self, row: int, what: str) -> int:
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
            raise BatchError(f"block_table.{what}: row must be an integer; got {row!r}")
        if not 0 <= row < self.num_rows:
            raise BatchError(
                f"block_table.{what}: row {row} is outside 0..{self.num_rows - 1} (batching.max_num_seqs rows)"
            )
        return int(row)

    def _blocks(self, block_ids: npt.ArrayLike, what: str, start: int) -> np.ndarray:
        try:
            blocks = np.asarray(block_ids)
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchError(f"block_table.{what}: block ids must be a 1-D array of integers; {exc}") from None
        if blocks.ndim != 1:
            raise BatchError(f"block_table.{what}: block ids must be 1-D; got shape {tuple(blocks.shape)}")
        if blocks.dtype.kind not in "iu":
            if blocks.size:
                raise BatchError(f"block_table.{what}: block ids must be integers; got dtype {blocks.dtype}")
            blocks = blocks.astype(np.int64)
        if start + len(blocks) > self.max_blocks_per_row:
            raise BatchError(
                f"block_table.{what}: the row would hold {start + len(blocks)} blocks; a row holds at most "
                f"{self.max_blocks_per_row} (kv_cache.max_model_len / block_size)"
            )
        limit = INT32_MAX + 1 if self._num_blocks is None else self._num_blocks
        if blocks.size:
            bad = np.flatnonzero((blocks < self._lowest) | (blocks >= limit))
            if bad.size:
                j = int(bad[0])
                if blocks[j] == 0:  # only where null_ok is False
                    raise BatchError(
                        f"block_table.{what}: block id 0 at index {j} is the null block, which padded requests "
                        "and capture's dummy runs share (capture writes it); a request's blocks are 1 and up"
                    )
                raise BatchError(
                    f"block_table.{what}: block id {int(blocks[j])} at index {j} is outside the KV cache "
                    f"[0, {limit}) (kv_cache.num_blocks)"
                )
        return blocks.astype(np.int32, copy=False)

    def _write(self, i: int, start: int, blocks: np.ndarray) -> None:
        stop = start + len(blocks)
        self._rows[i, start:stop] = blocks
        # int64: block * block_size may pass int32 before the column is subtracted.
        self.offsets[i, start:stop] = (blocks - self._columns[start:stop]) * self._block_size

    def _set_count(self, i: int, n: int) -> None:
        self.counts[i] = n
        self.capacity[i] = min(n * self._block_size, self._max_len)
        if n and i >= self.top:
            self.top = i + 1
        elif not n and i == self.top - 1:
            top = i
            while top and not self.counts[top - 1]:
                top -= 1
            self.top = top
