"""The staging passes of `PersistentBuffers`: check a step, then write its rows and padded tails.

Two passes share one contract (every check before the first write; a refused step leaves
the packed buffer byte-identical). The decode pass (every request computes one token, no
engine buffers) is flat: per `(key, num_reqs)` a cached plan holds every view, constant and
the resulting `ForwardInputs`, so a step is about twenty numpy calls on cached arrays. The
general pass handles the rest (prefill chunks, speculative decoding, engine buffers).

A fast check that fails hands the step to `_refusals.refuse_step`, which names the first
broken rule. Padded rows are written by `_padding.PaddedRows`, only where an earlier step
dirtied them.
"""

from __future__ import annotations

import numpy as np

from graphcap._extras import check_extras_fit, stage_extra
from graphcap._fastnp import INT32_MAX, amax, unsigned_max
from graphcap._padding import PaddedRows
from graphcap._plans import Plan, Plans
from graphcap._refusals import check_fits
from graphcap.batch import GraphKey, StepBatch
from graphcap.inputs import ForwardInputs

__all__ = ["Staging"]

_I32, _U32, _U64 = np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.uint64)
_count = np.count_nonzero  # (on bool scratch, `ok.tobytes() != all_true` is cheaper still)
_less, _add, _subtract = np.less, np.add, np.subtract


class Staging(Plans, PaddedRows):
    """The staging passes; `PersistentBuffers` derives from it (see that class for the contract)."""

    # -- entry -----------------------------------------------------------------------------

    def stage(self, batch: StepBatch, key: GraphKey, *, upload: bool = True) -> ForwardInputs:
        """Fill the buffers for `batch` padded to `key` and return the views for `key`.

        Real rows come from the batch; padded rows follow `limits.pad` (engine buffers: their
        `pad`). Every check runs before the first write: a refused step (`BatchError` naming
        the field and request) leaves the buffers byte-identical. The same `ForwardInputs`
        object comes back for every step of the same key and counts. `upload=False` leaves
        the device copy to a later `upload()` (the manager checks the host rows in between).
        """
        self._upload_now = upload
        if batch.max_query_len == 1 and self._plain and not batch.extras:
            plan = self._decode_plans.get((key, batch.num_reqs))
            if plan is not None:
                return self._stage_decode(batch, plan)
        check_fits(batch, key, self.max_num_tokens, self.max_num_reqs)
        if batch.max_query_len == 1 and self._plain and not batch.extras:
            return self._stage_decode(batch, self._decode_plan(key, batch.num_reqs))
        return self._stage_general(batch, key)

    # -- decode: one token per request -------------------------------------------------------

    def _stage_decode(self, batch: StepBatch, p: Plan) -> ForwardInputs:
        s, ids, bt = batch.seq_lens, batch.input_ids, batch.block_table
        r, pos, ok = p.r, p.pos, p.ok
        table = self.block_table
        # Checks. position = seq_len - 1 must lie in [0, capacity) of the request's blocks:
        # one unsigned comparison refuses seq_len < 1, > max_model_len and > its blocks.
        if s.dtype is not _I32 and unsigned_max(s) > INT32_MAX:
            self._refuse(batch, p.key)
        _subtract(s, p.ones, out=pos)
        if bt is table:
            _less(p.pos_u, p.table_cap, out=ok)
            if ok.tobytes() != p.all_true or (table.top > r and _count(p.counts_padded)):
                self._refuse(batch, p.key)
        else:
            if table.top or (bt is not None and type(bt) is not np.ndarray):
                self._refuse_table_source(bt)
            if bt is None:
                cap = p.null_cap
            elif bt.shape[1] == p.fresh_width:
                cap = p.fresh_cap
            else:
                cap = self._fresh_capacity(p, bt.shape[1])
            _less(p.pos_u, cap, out=ok)
            if ok.tobytes() != p.all_true:
                self._refuse(batch, p.key)
            if bt is not None and (
                bt.shape[1] > self.max_blocks_per_req
                or (amax(bt.view(_U32), axis=None) if bt.dtype is _I32 else unsigned_max(bt)) >= self._num_blocks
            ):
                self._refuse(batch, p.key)
        if ids is not None:
            if ids.dtype is not _I32:
                top = unsigned_max(ids)
                if top > INT32_MAX or top >= self._vocab_size:
                    self._refuse(batch, p.key)
            elif p.vocab is not None:
                _less(ids.view(_U32), p.vocab, out=ok)
                if ok.tobytes() != p.all_true:
                    self._refuse(batch, p.key)
            elif unsigned_max(ids) > INT32_MAX:
                self._refuse(batch, p.key)
        # Writes.
        if self._upload_pending:
            self._wait_upload()
        if self.poison:
            self._poison(bt is table)
        p.positions[...] = pos
        p.seq[...] = s
        if ids is None:
            p.ids.fill(0)
        else:
            p.ids[...] = ids
        if bt is table:
            if self._dirty_table_rows:
                self._claim_table_rows()
            slots, idx = p.slots, p.idx
            _add(s, p.row_offset, out=idx)  # seq_len - 1 + row * B * block_size
            self._div(idx, p.div, out=idx)
            table.flat_offsets.take(idx, out=slots, mode="clip")  # indices checked above
            _add(slots, pos, out=slots)
            if self._dirty_tokens > r or self._dirty_reqs > r:
                self._table_width = None
                self._fill_padding(p.T, p.R, r, r)
            else:
                self._dirty_tokens = self._dirty_reqs = r
        else:
            width = self._fresh_slots(bt, p, s, None)
            if self._dirty_tokens > r or self._dirty_reqs > r or self._dirty_table_rows > r:
                self._table_width = width
                self._fill_padding(p.T, p.R, r, r)
            else:  # nothing padded is dirty: only the bounds move
                self._dirty_tokens = self._dirty_reqs = self._dirty_table_rows = r
                self._dirty_table_cols = width
        if self._qsl_written is not p:
            p.qsl[...] = p.qsl_content
            self._qsl_written = p
        if p.upload is not None:
            self._upload_or_defer(p.upload)
        return p.inputs

    # -- any step ----------------------------------------------------------------------------

    def _stage_general(self, batch: StepBatch, key: GraphKey) -> ForwardInputs:
        n, r = batch.num_tokens, batch.num_reqs
        p = self._plans.get((key, n, r)) or self._general_plan(key, n, r)
        q, s, ids, bt = batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table
        table = self.block_table
        if bt is not table and (table.top or (bt is not None and type(bt) is not np.ndarray)):
            self._refuse_table_source(bt)
        if r:
            wide = s.dtype is not _I32
            if wide and unsigned_max(s) > INT32_MAX:
                self._refuse(batch, key)
            if bt is table:
                cap = p.table_cap
            elif bt is None:
                cap = p.null_cap
            else:
                cap = self._fresh_capacity(p, bt.shape[1])
            # 0 <= seq_len <= capacity (unsigned), then seq_len >= query_len.
            ok = p.ok_r
            np.less_equal(s.view(_U64 if wide else _U32), cap, out=ok)
            if ok.tobytes() != p.all_true_r or _count(_less(s, q, out=ok)):
                self._refuse(batch, key)
        if ids is not None and n:
            self._check_ids(batch, ids, p, n)
        if bt is table:
            if table.top > r and _count(p.counts_padded):
                self._refuse(batch, key)
        elif bt is not None and r and (bt.shape[1] > self.max_blocks_per_req or unsigned_max(bt) >= self._num_blocks):
            self._refuse(batch, key)
        if batch.extras or self.extras:
            check_extras_fit(self.extras, batch.extras, n, r)
        if self._upload_pending:
            self._wait_upload()
        if self.poison:
            self._poison(bt is table)
        if bt is table and self._dirty_table_rows:
            self._claim_table_rows()
        self._qsl_written = None
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
            self._row_mod(u, p.row_span, out=p.positions)
            p.seq[...] = s
            self._div(u, p.div, out=u)
            if bt is table:
                table.flat_offsets.take(u, out=p.slots, mode="clip")  # indices checked above
                _add(p.slots, p.positions, out=p.slots)
        self._table_width = None if bt is table else self._fresh_slots(bt, p, None, q)
        if ids is None:
            p.ids.fill(0)
        else:
            p.ids[...] = ids
        T, R = key.num_tokens, key.num_reqs
        if r < R:
            p.qsl[r + 1 :] = self._qsl_tail(T, R, n, r)
        self._fill_padding(T, R, n, r)
        for spec in self.extras:
            stage_extra(self.host[spec.name], spec, batch.extras.get(spec.name), T, R, n, r)
        if p.upload is not None:
            self._upload_or_defer(p.upload)
        return p.inputs
