"""Extra KV-cache groups (`kv_cache.groups`) in staging: each group's block table and slot mapping.

A hybrid model keeps several paged caches (sliding-window and full attention layers, attention
and state-space layers), each with its own block size and block ids. Every extra group gets
what the built-in one has: a persistent `BlockTable` (or a fresh table per step, or the null
block for graphcap's own batches), its slots computed from the step's positions, padded rows
written from the pad rules only where a step dirtied them, and the invariants
(`graphcap.checks.kv_writes`). A step is checked for every group before anything is written. Steps of
engines without groups never enter this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from types import MappingProxyType
from typing import Any

import numpy as np

from graphcap._fastnp import unsigned_max
from graphcap.batch import StepBatch
from graphcap.block_table import BlockTable
from graphcap.config import PadRules
from graphcap.errors import BatchError
from graphcap.inputs import KVGroup, KVGroupView

__all__ = ["GroupStaging"]


class _Group:
    """One group's host rows, persistent table and dirty bounds (rows at or above a bound hold their pad)."""

    def __init__(self, spec: KVGroup, host: Mapping[str, np.ndarray], table: BlockTable) -> None:
        self.spec = spec
        self.rows = host[spec.table_field]  # [max_num_reqs, B] int32
        self.slots = host[spec.slots_field]  # [max_num_tokens] int32
        self.flat = self.rows.reshape(-1)
        self.table = table
        self.tokens, self.table_rows, self.table_cols = len(self.slots), len(self.rows), self.rows.shape[1]


class GroupStaging:
    """The extra groups of one `PersistentBuffers`: checks, real rows, padded rows, persistent tables.

    `tables[name]` is the group's persistent `BlockTable` (a step names it in
    `StepBatch(kv_groups={name: table})`, request i reading row i, as for the built-in table).
    """

    def __init__(
        self,
        specs: tuple[KVGroup, ...],
        host: Mapping[str, np.ndarray],
        pad: PadRules,
        max_model_len: int | None,
        before_write: Callable[[], None],
    ) -> None:
        self.specs = specs
        self.pad = pad
        self._before_write = before_write
        self._groups: dict[str, _Group] = {}
        for spec in specs:
            table = BlockTable(
                host[spec.table_field],
                block_size=spec.block_size,
                num_blocks=spec.num_blocks,
                max_model_len=max_model_len,
                pad_block=pad.block_id,
                before_write=functools.partial(self._claim, spec.name),
                null_ok=spec.sliding_window is not None,
            )
            self._groups[spec.name] = _Group(spec, host, table)
        self.tables: Mapping[str, BlockTable] = MappingProxyType({n: g.table for n, g in self._groups.items()})
        self.forget()
        for group in self._groups.values():  # the zeroed rows get their pad once
            self._fill(group, 0, 0, len(group.slots), len(group.rows), 0)

    def __bool__(self) -> bool:
        return bool(self.specs)

    # -- a step ----------------------------------------------------------------------------

    def check(self, batch: StepBatch, R: int) -> list[Any]:
        """Each group's table source for `batch` (a `BlockTable`, an array or None), every rule checked.

        `BatchError` naming the group and the rule; nothing is written.
        """
        given = batch.kv_groups
        unknown = [name for name in given if name not in self._groups]
        if unknown:
            known = ", ".join(self._groups)
            raise BatchError(f"kv_groups[{unknown[0]!r}]: no such KV-cache group; groups: {known} (kv_cache.groups)")
        r, s = batch.num_reqs, batch.seq_lens
        sources = []
        for name, group in self._groups.items():
            source = given.get(name)
            what = f"kv_groups[{name!r}]"
            if source is None and batch.block_table is not None:
                raise BatchError(
                    f"{what} is missing: the step gives block_table, so it must give every group's table "
                    f"(StepBatch(..., kv_groups={{{name!r}: ...}})); only graphcap's own batches use the null block"
                )
            table = group.table
            if source is not table and table.top:
                raise BatchError(
                    f"{what}: the step passes {'no table' if source is None else 'its own table'}, but the group's "
                    f"persistent block table holds blocks in rows 0..{table.top - 1}; pass that table "
                    "(manager.kv_group_tables[name]) or clear its rows first"
                )
            if isinstance(source, BlockTable):
                if source is not table:
                    raise BatchError(f"{what} is a BlockTable of another group or manager; pass this group's table")
                try:
                    table.check_step(s, r, R)
                except BatchError as exc:
                    raise BatchError(f"{what} (the group's persistent table): {exc}") from None
            elif source is not None and r:
                self._check_fresh(group.spec, source, s, what)
            sources.append(source)
        return sources

    def stage(self, sources: list[Any], batch: StepBatch, positions: np.ndarray, T: int, R: int) -> None:
        """Write each group's real rows (its table, slots from `positions`) and padded rows."""
        n, r = batch.num_tokens, batch.num_reqs
        req = np.repeat(np.arange(r, dtype=np.intp), batch.query_lens) if n else np.zeros(0, np.intp)
        pos = positions[:n].astype(np.intp)
        for group, source in zip(self._groups.values(), sources):
            bs, width = group.spec.block_size, group.rows.shape[1]
            flat = req * width + pos // bs  # the table entry of each token's position
            slots = group.slots[:n]
            if source is group.table:
                if group.table_rows:
                    self._claim(group.spec.name)
                np.add(group.table.flat_offsets[flat], pos, out=slots, casting="unsafe")
                self._fill(group, n, r, T, R, None)
                continue
            cols = width if source is None else source.shape[1]
            if r:
                group.rows[:r, :cols] = 0 if source is None else source  # None: the null block
                if cols < group.table_cols:
                    group.rows[:r, cols : group.table_cols] = self.pad.block_id
            np.add(group.flat[flat] * bs, pos % bs, out=slots, casting="unsafe")
            self._fill(group, n, r, T, R, cols if r else 0)

    def silence(self, n: int) -> None:
        """The first `n` tokens write no KV slot in any group (a verification batch reading live blocks)."""
        for group in self._groups.values():
            group.slots[:n] = self.pad.slot

    def views(self, tensors: Mapping[str, Any], host: Mapping[str, np.ndarray]) -> tuple[Mapping, Mapping]:
        """The `kv_groups` of a `ForwardInputs` and of its `HostView`, from one key's views by field name."""
        made = [
            {g.name: KVGroupView(rows[g.table_field], rows[g.slots_field], g.block_size, g.sliding_window)
             for g in self.specs}
            for rows in (tensors, host)
        ]  # fmt: skip
        return MappingProxyType(made[0]), MappingProxyType(made[1])

    # -- lifecycle -------------------------------------------------------------------------

    def resize(self, name: str, num_blocks: int) -> None:
        """Group `name`'s cache now holds `num_blocks` blocks (refused first if its table holds blocks past it)."""
        group = self._groups[name]
        group.table.resize(num_blocks)
        group.spec = group.spec._replace(num_blocks=num_blocks)
        self.specs = tuple(g.spec for g in self._groups.values())

    @contextmanager
    def tables_set_aside(self, set_aside: Callable[[BlockTable], Any]) -> Iterator[None]:
        """Every group's persistent table set aside (`set_aside(table)`: a context manager) inside."""
        with ExitStack() as stack:
            for group in self._groups.values():
                stack.enter_context(set_aside(group.table))
            yield

    def kept_spans(self, span: Callable[[str], tuple[int, int]]) -> list[tuple[int, int]]:
        """Byte spans of the persistent tables that hold rows (poisoning must keep them)."""
        return [span(g.spec.table_field) for g in self._groups.values() if g.table.top]

    def forget(self) -> None:
        """Trust no padded row (after poisoning or a failed check); persistent rows that hold blocks stay."""
        for group in self._groups.values():
            group.tokens = len(group.slots)
            if not group.table.top:
                group.table_rows, group.table_cols = len(group.rows), group.rows.shape[1]

    # -- internals ---------------------------------------------------------------------------

    def _check_fresh(self, spec: KVGroup, table: np.ndarray, s: np.ndarray, what: str) -> None:
        width = table.shape[1]
        if width > spec.max_blocks_per_req:
            raise BatchError(
                f"{what} has {width} columns; the group's table holds {spec.max_blocks_per_req} per request "
                f"(kv_cache.max_model_len / its block_size {spec.block_size})"
            )
        if table.size and unsigned_max(table) >= spec.num_blocks:
            i, j = (int(v) for v in np.argwhere((table < 0) | (table >= spec.num_blocks))[0])
            raise BatchError(
                f"{what}[{i}, {j}] is {int(table[i, j])}, outside the group's KV cache [0, {spec.num_blocks}) "
                f"(kv_cache.groups num_blocks of {spec.name!r})"
            )
        need = -(-s.astype(np.int64) // spec.block_size)
        if need.max(initial=0) > width:
            i = int(np.argmax(need > width))
            raise BatchError(
                f"request {i} has seq_len {int(s[i])}, which needs {int(need[i])} blocks of {spec.block_size} in "
                f"group {spec.name!r}, but {what} has {width} columns"
            )

    def _claim(self, name: str) -> None:
        """Before a persistent table's rows are written or used: clear what fresh-table steps left there."""
        self._before_write()
        group = self._groups[name]
        if group.table_rows:
            group.rows[: group.table_rows, : group.table_cols] = self.pad.block_id
            group.table_rows = group.table_cols = 0

    def _fill(self, group: _Group, n: int, r: int, T: int, R: int, width: int | None) -> None:
        """Padded rows `[real : padded]` of a group hold the pad, rewritten only where dirty (as `PadWriter`)."""
        dirty = group.tokens
        if n < T and dirty > n:
            group.slots[n : min(T, dirty)] = self.pad.slot
        group.tokens = n if dirty <= T else dirty
        if width is None:  # a persistent table keeps rows outside a step empty itself
            return
        dirty, cols = group.table_rows, group.table_cols
        if r < R and dirty > r and cols:
            group.rows[r : min(R, dirty), :cols] = self.pad.block_id
        group.table_rows = r if dirty <= R else dirty
        group.table_cols = max(width, cols) if dirty > R else width
