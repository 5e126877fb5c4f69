"""`PersistentBuffers`: the static inputs every graph reads, and the one path that fills them.

Dummy runs (capture) and real steps both go through `PersistentBuffers.stage`, so there is no
second place to forget a padded tail. The buffers are allocated once at the maxima and never
reallocated: a captured graph keeps reading the addresses it was captured with. The staged
`block_table` rows double as the persistent block table (`BlockTable`) of engines that keep one.

The parts, each owning its state: `PackedLayout` (the packed host/device buffer, views per
key, the upload), `PadWriter` (padded rows and their dirty bounds), `PlanCache` (per-step
plans and scratch) and `BlockTable`; the passes (`staging.passes`) are functions over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import cast

import numpy as np
import torch

from graphcap.batch import StepBatch
from graphcap.block_table import BlockTable
from graphcap.config import CaptureConfig, PadRules
from graphcap.fields import COUNTS_ENTRY, FIELD_TABLE
from graphcap.inputs import BufferSpec, ForwardInputs, KVGroup, StagingLimits
from graphcap.keys import GraphKey
from graphcap.staging.extras import check_extras, full_shape, pad_extra
from graphcap.staging.groups import GroupStaging
from graphcap.staging.layout import Entry, PackedLayout
from graphcap.staging.padding import PadWriter
from graphcap.staging.passes import stage_decode, stage_general
from graphcap.staging.plans import PlanCache
from graphcap.staging.refusals import check_fits

__all__ = ["POISON", "PersistentBuffers"]

POISON = np.int32(-0x41414142)
"""What poisoned int32 rows hold before each staging (`checks.poison_padding`): any padded row
the pad rules forgot stays at it, an absurd value that invariants and kernels trip over."""


class PersistentBuffers:
    """Static input buffers allocated once at the maxima; `stage()` fills them for a step.

    Normally `CaptureManager` owns one and calls `stage` for every step and dummy batch.
    Does not decide keys (the manager's registry does) and does not run the model. Not
    thread-safe: one staging at a time (the manager holds a lock around stage + replay).
    `block_table` is the persistent block table (`BlockTable`) whose rows are the staged
    `block_table` buffer: steps that name it skip copying and scanning a table each step.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks_per_req: int,
        device: torch.device | str = "cpu",
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        pad_rules: PadRules | None = None,
        poison: bool = False,
        extras: Iterable[BufferSpec] = (),
        kv_groups: Iterable[KVGroup] = (),
    ) -> None:
        for name, value in (
            ("max_num_reqs", max_num_reqs),
            ("max_num_tokens", max_num_tokens),
            ("max_blocks_per_req", max_blocks_per_req),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PersistentBuffers: {name} must be an integer >= 1; got {value!r}")
        extras = tuple(extras)
        check_extras(extras)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        pad = pad_rules or PadRules()
        groups = tuple(kv_groups)
        self.limits = StagingLimits(
            block_size, max_blocks_per_req, num_blocks, vocab_size, max_model_len, pad, extras, groups
        )
        self.extras = extras
        self.poison = poison
        R, T, B = max_num_reqs, max_num_tokens, max_blocks_per_req
        # Built-ins then extras, the block table last, so one prefix covers every staged row of a key.
        counts = {"tokens": T, "reqs": R, "reqs+1": R + 1}
        i32 = np.dtype(np.int32)
        entries = [
            Entry(f.name, (counts[f.rows], B) if f.width else (counts[f.rows],), i32, f.rows) for f in FIELD_TABLE
        ]
        entries[-1:-1] = [Entry(COUNTS_ENTRY, (2,), i32, "none")]  # the step's real counts (COUNT_FIELDS)
        entries[-1:-1] = [Entry(s.name, full_shape(s, T, R), s.np_dtype, s.rows, s.row_dim) for s in extras]
        for g in groups:  # before the built-in block table too: one upload prefix still covers a key's rows
            entries[-1:-1] = [
                Entry(g.slots_field, (T,), i32, "tokens"),
                Entry(g.table_field, (R, g.max_blocks_per_req), i32, "reqs"),
            ]
        self.layout = PackedLayout(entries, self.device)
        host = self.layout.host
        self.host: Mapping[str, np.ndarray] = host
        """Full-size host views (numpy) by name."""
        self.block_table = BlockTable(
            host["block_table"],
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            pad_block=pad.block_id,
            before_write=self._before_table_write,
        )
        self.pad = PadWriter(host, pad, T, R)
        self.kv_groups = GroupStaging(groups, host, pad, max_model_len, self._before_group_write)
        self.plans = PlanCache(self.layout, self.block_table, self.limits, T, R, self.kv_groups.views)
        self._plain = not extras and not groups  # the decode pass serves steps without engine buffers or groups
        self._upload_now = True
        self._pending_upload: tuple[torch.Tensor, torch.Tensor] | None = None  # staged, not yet uploaded
        for spec in extras:
            pad_extra(host[spec.name], spec, T, R, 0, 0)
        self.layout.start_device()

    @classmethod
    def from_config(
        cls, config: CaptureConfig, device: torch.device | str | None = None, *, extras: Sequence[BufferSpec] = ()
    ) -> PersistentBuffers:
        """Buffers sized from a `CaptureConfig` (batching maxima, KV cache, pad rules)."""
        kv = config.kv_cache
        return cls(
            config.batching.max_num_seqs,
            config.batching.max_num_tokens,
            kv.max_blocks_per_req,
            device if device is not None else "cpu",
            block_size=kv.block_size,
            num_blocks=kv.num_blocks,
            vocab_size=config.model.vocab_size,
            max_model_len=kv.max_model_len,
            pad_rules=config.padding,
            poison=config.checks.poison_padding,
            extras=extras,
            kv_groups=(  # each group's num_blocks is set: a group without it is refused at load
                KVGroup(
                    g.name,
                    g.block_size,
                    cast(int, g.num_blocks),
                    g.max_blocks_per_req(kv.max_model_len),
                    g.sliding_window,
                )
                for g in kv.groups
            ),
        )

    # -- staging ---------------------------------------------------------------------------

    def stage(self, batch: StepBatch, key: GraphKey, *, upload: bool = True) -> ForwardInputs:
        """Fill the buffers for `batch` padded to `key` and return the views for `key`.

        Real rows come from the batch; padded rows follow `limits.pad` (engine buffers: their
        `pad`). A key of any request count (`num_reqs` None, a piecewise graph) pads tokens
        only: the step's own requests are its request rows. Every check runs before the first
        write: a refused step (`BatchError` naming the field and request) leaves the buffers
        byte-identical. The same `ForwardInputs` object comes back for every step of the same
        key and counts. `upload=False` leaves the device copy to a later `upload()` (the manager
        checks the host rows in between).
        """
        self._upload_now = upload
        decode = batch.max_query_len == 1 and self._plain and not batch.extras and not batch.kv_groups
        if decode:
            plan = self.plans.decode_plans.get((key, batch.num_reqs))
            if plan is not None:
                return stage_decode(self, batch, plan)
        check_fits(batch, key, self.max_num_tokens, self.max_num_reqs)
        R = batch.num_reqs if key.num_reqs is None else key.num_reqs
        if decode:
            r = batch.num_reqs
            plan = self.plans.decode(key, R, r, self.pad.qsl_tail(key.num_tokens, R, r, r))
            return stage_decode(self, batch, plan)
        return stage_general(self, batch, key, R)

    def upload(self) -> None:
        """Copy the rows of the last `stage(..., upload=False)` to the device: one copy; nothing on CPU.

        The manager stages, lets the model's `prepare` plan, checks the invariants on the host
        rows, then uploads them.
        """
        rows, self._pending_upload = self._pending_upload, None
        if rows is not None:
            self.layout.upload(rows)

    def upload_or_defer(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Upload `rows` now, or keep them for `upload()` when the stage asked for `upload=False`."""
        if self._upload_now:
            self.layout.upload(rows)
        else:
            self._pending_upload = rows

    def forget_padding(self) -> None:
        """Trust no padded row: the next step rewrites them all (after a check found staged rows broken)."""
        self.pad.forget(kept_table=self.block_table.top > 0)
        self.kv_groups.forget()

    def silence_kv_writes(self, inputs: ForwardInputs) -> None:
        """The staged real tokens write no KV slot in any group (a verification batch reading live blocks)."""
        inputs.host.slot_mapping[: inputs.num_tokens] = self.limits.pad.slot
        if self.kv_groups:
            self.kv_groups.silence(inputs.num_tokens)

    def upload_nbytes(self, key: GraphKey, num_reqs: int | None = None) -> int:
        """Bytes one step of `key` uploads on CUDA: the packed prefix that holds every row of the key.

        `num_reqs`: the step's request count, for a key of any request count (piecewise).
        """
        R = key.num_reqs if key.num_reqs is not None else (num_reqs or 0)
        return self.layout.views(key.num_tokens, R).end

    def resize_kv(self, num_blocks: int, group: str | None = None) -> None:
        """The KV cache (of `group`; None: the built-in one) now holds `num_blocks` blocks.

        Later steps, checks and block-table writes use the new bound. `BatchError` naming the row,
        before any change, when the persistent block table holds a block past a smaller bound.
        """
        if group is not None:
            self.kv_groups.resize(group, num_blocks)
            self.limits = dataclasses.replace(self.limits, kv_groups=self.kv_groups.specs)
        else:
            self.block_table.resize(num_blocks)
            self.limits = dataclasses.replace(self.limits, num_blocks=num_blocks)
        self.plans.set_limits(self.limits)  # plans hold the ForwardInputs of the old limits
        self.pad.mark_qsl(None)

    # -- the persistent block table --------------------------------------------------------

    def _before_table_write(self) -> None:
        """Called by `block_table` before it writes a row: the rows must be ours to write."""
        self._before_group_write()
        self.pad.claim_table_rows()

    def _before_group_write(self) -> None:
        """Called before a group's persistent table writes a row: no upload may still read the rows."""
        if self.layout.upload_pending:
            self.layout.wait()

    @contextmanager
    def table_set_aside(self) -> Iterator[None]:
        """Keep the persistent block tables' rows (every group's) out of the way of steps that bring their own.

        Inside, the tables are empty (dummy batches of a capture pass can stage fresh tables);
        on exit every row holds its blocks again. O(rows held) copies each way.
        """
        with self._set_aside(self.block_table, self.pad.claim_table_rows):
            if not self.kv_groups:
                yield
                return
            with self.kv_groups.tables_set_aside(lambda table: self._set_aside(table, table.before_write)):
                yield

    @contextmanager
    def _set_aside(self, table: BlockTable, claim: Callable[[], None]) -> Iterator[None]:
        if not table.top:
            yield
            return
        saved = table.snapshot()
        table.reset()
        try:
            yield
        finally:
            if self.layout.upload_pending:
                self.layout.wait()
            claim()
            table.restore(saved)

    # -- poison ----------------------------------------------------------------------------

    def poison_rows(self, keep_table: bool) -> None:
        """Fill every byte with 0xBE (int rows read POISON), floats with NaN, bools with True.

        `keep_table`: the persistent block table's rows stay (steps do not write them).
        """
        packed = self.layout.packed
        kept = [self.layout.span("block_table")] if keep_table else []
        if self.kv_groups:
            kept += self.kv_groups.kept_spans(self.layout.span)
        start = 0
        for low, high in sorted(kept):
            packed[start:low].fill(0xBE)
            start = high
        packed[start:].fill(0xBE)
        for entry in self.layout.entries:
            if entry.dtype.kind == "f":
                self.host[entry.name].fill(np.nan)
            elif entry.dtype.kind == "b":
                self.host[entry.name].fill(True)
        self.pad.forget(keep_table)
        self.kv_groups.forget()

    # -- storage ---------------------------------------------------------------------------

    def storage(self) -> dict[str, torch.Tensor]:
        """The persistent device storage (the whole packed buffer) by name."""
        return {"packed": self.layout.device_tensor}

    @property
    def packed_host(self) -> np.ndarray:
        """The packed host staging buffer as bytes (snapshots in tests and fault checks)."""
        return self.layout.packed

    @property
    def nbytes(self) -> int:
        """Bytes of the packed metadata (each of host and device on CUDA)."""
        return self.layout.packed.nbytes
