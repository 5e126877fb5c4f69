"""The staging passes: check a step, then write its rows and padded tails into the buffers' parts.

Two passes share one contract (every check before the first write; a refused step leaves
the packed buffer byte-identical). The decode pass (every request computes one token, no
engine buffers) is flat: a cached plan holds every view, constant and the resulting
`ForwardInputs`, so a step is about twenty numpy calls on cached arrays. The general pass
handles the rest (prefill chunks, speculative decoding, engine buffers).

A fast check that fails hands the step to `staging.refusals.refuse_step`, which names the
first broken rule. Padded rows are written by the `PadWriter`, only where an earlier step
dirtied them.
"""

from __future__ import annotations

from typing import NoReturn, Protocol, cast

import numpy as np
import torch

from graphcap._fastnp import amax, unsigned_max
from graphcap.batch import StepBatch
from graphcap.block_table import BlockTable
from graphcap.errors import BatchError
from graphcap.fields import INT32_MAX
from graphcap.inputs import BufferSpec, ForwardInputs, StagingLimits
from graphcap.keys import GraphKey
from graphcap.staging.extras import check_extras_fit, stage_extra
from graphcap.staging.groups import GroupStaging
from graphcap.staging.layout import PackedLayout
from graphcap.staging.padding import PadWriter
from graphcap.staging.plans import Plan, PlanCache
from graphcap.staging.refusals import refuse_internal, refuse_step

__all__ = ["Parts", "stage_decode", "stage_general"]


class Parts(Protocol):
    """What the passes read and write: the parts of `PersistentBuffers` and its limits."""

    layout: PackedLayout
    pad: PadWriter
    plans: PlanCache
    block_table: BlockTable
    kv_groups: GroupStaging
    limits: StagingLimits
    extras: tuple[BufferSpec, ...]
    poison: bool
    max_num_tokens: int
    max_num_reqs: int
    max_blocks_per_req: int

    def poison_rows(self, keep_table: bool) -> None: ...

    def upload_or_defer(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None: ...


_I32, _U32, _U64 = np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.uint64)
_count = np.count_nonzero  # (on bool scratch, `ok.tobytes() != all_true` is cheaper still)
_less, _add, _subtract = np.less, np.add, np.subtract


def stage_decode(bufs: Parts, batch: StepBatch, p: Plan) -> ForwardInputs:
    """One token per request, no engine buffers: check, then write, through the decode plan `p`."""
    s, ids, bt = batch.seq_lens, batch.input_ids, batch.block_table
    r, pos, ok = p.r, p.pos, p.ok
    table, plans, pad, layout = bufs.block_table, bufs.plans, bufs.pad, bufs.layout
    # Checks. position = seq_len - 1 must lie in [0, capacity) of the request's blocks:
    # one unsigned comparison refuses seq_len < 1, > max_model_len and > its blocks.
    if s.dtype is not _I32 and unsigned_max(s) > INT32_MAX:
        _refuse(bufs, batch, p.key)
    _subtract(s, p.ones, out=pos)
    if bt is table:
        _less(p.pos_u, p.table_cap, out=ok)
        if ok.tobytes() != p.all_true or (table.top > r and _count(p.counts_padded)):
            _refuse(bufs, batch, p.key)
    else:
        if table.top or (bt is not None and type(bt) is not np.ndarray):
            _refuse_table_source(bt, table.top)
        if bt is None:
            cap = p.null_cap
        elif bt.shape[1] == p.fresh_width:
            cap = p.fresh_cap
        else:
            cap = plans.fresh_capacity(p, bt.shape[1])
        _less(p.pos_u, cap, out=ok)
        if ok.tobytes() != p.all_true:
            _refuse(bufs, batch, p.key)
        if bt is not None and (
            bt.shape[1] > bufs.max_blocks_per_req
            or (amax(bt.view(_U32), axis=None) if bt.dtype is _I32 else unsigned_max(bt)) >= plans.num_blocks
        ):
            _refuse(bufs, batch, p.key)
    if ids is not None:
        if ids.dtype is not _I32:
            top = unsigned_max(ids)
            if top > INT32_MAX or top >= plans.vocab_size:
                _refuse(bufs, batch, p.key)
        elif p.vocab is not None:
            _less(ids.view(_U32), p.vocab, out=ok)
            if ok.tobytes() != p.all_true:
                _refuse(bufs, batch, p.key)
        elif unsigned_max(ids) > INT32_MAX:
            _refuse(bufs, batch, p.key)
    # Writes.
    if layout.upload_pending:
        layout.wait()
    if bufs.poison:
        bufs.poison_rows(keep_table=bt is table)
    p.positions[...] = pos
    p.seq[...] = s
    if ids is None:
        p.ids.fill(0)
    else:
        p.ids[...] = ids
    if bt is table:
        if pad.table_rows:
            pad.claim_table_rows()
        slots, idx = p.slots, p.idx
        _add(s, p.row_offset, out=idx)  # seq_len - 1 + row * B * block_size
        plans.div(idx, p.div, out=idx)
        table.flat_offsets.take(idx, out=slots, mode="clip")  # indices checked above
        _add(slots, pos, out=slots)
        if pad.tokens > r or pad.reqs > r:
            pad.fill(p.T, p.R, r, r, None)
        else:
            pad.clean(r)
    else:
        width = _fresh_slots(bufs, bt, p, s, None)
        if pad.tokens > r or pad.reqs > r or pad.table_rows > r:
            pad.fill(p.T, p.R, r, r, width)
        else:  # nothing padded is dirty: only the bounds move
            pad.clean(r, table_cols=width)
    if pad.qsl_written is not p:  # the counts too: whatever wrote other query_start_loc rows wrote them
        p.qsl[...] = p.qsl_content
        p.counts[...] = p.count_values
        pad.mark_qsl(p)
    if p.upload is not None:
        bufs.upload_or_defer(p.upload)
    return p.inputs


def stage_general(bufs: Parts, batch: StepBatch, key: GraphKey, R: int) -> ForwardInputs:
    """Any step (prefill chunks, speculative decoding, engine buffers), padded to `(key.num_tokens, R)`."""
    n, r = batch.num_tokens, batch.num_reqs
    plans, pad, table = bufs.plans, bufs.pad, bufs.block_table
    p = plans.general(key, R, n, r)
    q, s, ids, bt = batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table
    if bt is not table and (table.top or (bt is not None and type(bt) is not np.ndarray)):
        _refuse_table_source(bt, table.top)
    if r:
        wide = s.dtype is not _I32
        if wide and unsigned_max(s) > INT32_MAX:
            _refuse(bufs, batch, key)
        if bt is table:
            cap = p.table_cap
        elif bt is None:
            cap = p.null_cap
        else:  # an array (any other source was refused above)
            cap = plans.fresh_capacity(p, cast(np.ndarray, bt).shape[1])
        # 0 <= seq_len <= capacity (unsigned), then seq_len >= query_len.
        ok = p.ok_r
        np.less_equal(s.view(_U64 if wide else _U32), cap, out=ok)
        if ok.tobytes() != p.all_true_r or _count(_less(s, q, out=ok)):
            _refuse(bufs, batch, key)
    if ids is not None and n:
        _check_ids(bufs, batch, ids, p)
    if bt is table:
        if table.top > r and _count(p.counts_padded):
            _refuse(bufs, batch, key)
    elif bt is not None and r:  # an array
        fresh = cast(np.ndarray, bt)
        if fresh.shape[1] > bufs.max_blocks_per_req or unsigned_max(fresh) >= plans.num_blocks:
            _refuse(bufs, batch, key)
    if batch.extras or bufs.extras:
        check_extras_fit(bufs.extras, batch.extras, n, r)
    groups = bufs.kv_groups
    if groups.specs or batch.kv_groups:
        if not groups:
            raise BatchError(f"the step gives kv_groups {sorted(batch.kv_groups)}, but kv_cache.groups declares none")
        sources = groups.check(batch, R)
    layout = bufs.layout
    if layout.upload_pending:
        layout.wait()
    if bufs.poison:
        bufs.poison_rows(keep_table=bt is table)
    if bt is table and pad.table_rows:
        pad.claim_table_rows()
    pad.mark_qsl(None)
    p.qsl[0] = 0
    np.add.accumulate(q, out=p.qsl_from_1)
    if r:
        # Token t (of n) of request i sits at position base[i] + t, base = context - start.
        # With `row_offset[i] = i * B * block_size`, u = position + row_offset[row] gives
        # both the position (u mod B * block_size) and the flat table index (u // block_size).
        base = p.tmp[:r]
        _subtract(s, q, out=base)
        _subtract(base, p.qsl_real, out=base)
        u = p.u
        _add(base, p.row_offset, out=p.u_reqs)
        _add(np.repeat(p.u_reqs, q), p.arange, out=u)
        plans.row_mod(u, p.row_span, out=p.positions)
        p.seq[...] = s
        plans.div(u, p.div, out=u)
        if bt is table:
            table.flat_offsets.take(u, out=p.slots, mode="clip")  # indices checked above
            _add(p.slots, p.positions, out=p.slots)
    width = None if bt is table else _fresh_slots(bufs, bt, p, None, q)
    if ids is None:
        p.ids.fill(0)
    else:
        p.ids[...] = ids
    T = key.num_tokens
    if r < R:
        p.qsl[r + 1 :] = pad.qsl_tail(T, R, n, r)
    pad.fill(T, R, n, r, width)
    p.counts[...] = p.count_values
    host = bufs.layout.host
    for spec in bufs.extras:
        stage_extra(host[spec.name], spec, batch.extras.get(spec.name), T, R, n, r)
    if groups.specs:
        groups.stage(sources, batch, p.positions, T, R)
    if p.upload is not None:
        bufs.upload_or_defer(p.upload)
    return p.inputs


def _check_ids(bufs: Parts, batch: StepBatch, ids: np.ndarray, p: Plan) -> None:
    if ids.dtype is _I32:
        if p.vocab is not None:
            _less(ids.view(_U32), p.vocab, out=p.ok)
            if p.ok.tobytes() != p.all_true:
                _refuse(bufs, batch, p.key)
        elif unsigned_max(ids) > INT32_MAX:
            _refuse(bufs, batch, p.key)
    else:
        top = unsigned_max(ids)
        if top > INT32_MAX or top >= bufs.plans.vocab_size:
            _refuse(bufs, batch, p.key)


def _fresh_slots(bufs: Parts, bt, p: Plan, base: np.ndarray | None, q) -> int:
    """Stage a fresh table into the rows (or the null block 0) and compute slots; return its width.

    Decode (`q` None): `base` is `seq_lens`; otherwise the general pass left each token's flat
    table index in the plan's scratch (`p.u`).
    """
    plans = bufs.plans
    r, slots, idx = p.r, p.slots, p.idx
    if bt is None:
        if r:
            p.table[...] = 0  # the null block
            plans.mod(p.positions, p.mod_operand, out=slots)
        return bufs.max_blocks_per_req if r else 0
    width = bt.shape[1]
    if not r:
        return 0
    if width == bufs.max_blocks_per_req:
        p.table[...] = bt  # a memcpy (numpy casts int64 tables)
    else:
        p.table[:, :width] = bt
        pad = bufs.pad
        if pad.table_cols > width:  # columns an earlier, wider table left
            p.table[:, width : pad.table_cols] = bufs.limits.pad.block_id
    if q is None:  # decode: flat index of each request's last token
        _add(cast(np.ndarray, base), p.row_offset, out=idx)  # seq_len - 1 + row * B * block_size
        plans.div(idx, p.div, out=idx)
    else:  # the general pass computed it
        idx = p.u
    plans.block_rows_flat.take(idx, out=slots, mode="clip")  # block ids; indices checked above
    np.multiply(slots, p.modulus, out=slots)
    plans.mod(p.positions, p.mod_operand, out=p.tmp)
    _add(slots, p.tmp, out=slots)
    return width


def _refuse_table_source(bt, top: int) -> NoReturn:
    """A step that brings its own table (or the null block) while the persistent table holds rows."""
    if bt is not None and type(bt) is not np.ndarray:
        raise BatchError(
            f"block_table is a {type(bt).__name__} that belongs to other buffers; pass this manager's block_table"
        )
    what = "no block table (the null block)" if bt is None else "its own block table"
    raise BatchError(
        f"the step passes {what}, but the persistent block table holds blocks in rows "
        f"0..{top - 1}; pass block_table=<the manager's block_table> (request i reads "
        "row i), or clear its rows first"
    )


def _refuse(bufs: Parts, batch: StepBatch, key: GraphKey) -> NoReturn:
    refuse_step(batch, key, bufs.limits, (bufs.max_num_tokens, bufs.max_num_reqs), bufs.block_table)
    refuse_internal(f"{batch!r} into {key}")
