"""Per-step plans of the staging passes, their scratch and constants, and the checks they share.

A plan holds everything a step of one `(key, num_tokens, num_reqs)` reuses: views of the
buffers' rows, scratch slices, constant operands (a ufunc given a cached array runs faster
than given a Python int) and the `ForwardInputs` the step returns. Plans are made once per
combination (at most `_MAX_PLANS` of each kind are kept) after the step's counts were
checked against the key, so a cached plan is proof that those counts fit.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from graphcap._fastnp import INT32_MAX, filled, unsigned_max
from graphcap._refusals import refuse_internal, refuse_step
from graphcap.batch import GraphKey, StepBatch
from graphcap.errors import BatchError
from graphcap.inputs import ForwardInputs

__all__ = ["Plan", "Plans"]

_I32, _U32 = np.dtype(np.int32), np.dtype(np.uint32)
_MAX_PLANS = 1024
_less, _add = np.less, np.add


class Plan:
    """Everything a step of `(key, num_tokens, num_reqs)` reuses: views, constants, its `ForwardInputs`."""

    __slots__ = (
        "key", "T", "R", "n", "r", "inputs", "upload", "ok", "ok_r", "pos", "pos_u", "idx", "tmp", "ones", "vocab",
        "ids", "positions", "slots", "seq", "table", "table_cap", "null_cap", "row_offset", "div", "modulus",
        "qsl", "qsl_from_1", "qsl_real", "qsl_content", "counts_padded", "arange", "all_true", "all_true_r",
        "fresh_width", "fresh_cap", "u", "u_reqs", "row_span", "mod_operand",
    )  # fmt: skip


class Plans:
    """Plans, scratch and shared checks of the staging passes; a mixin of `PersistentBuffers` (via `Staging`)."""

    def _init_plans(self) -> None:
        T, R, B = self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req
        lim = self.limits
        bs = lim.block_size
        size = max(T, R) + 1
        # Scratch outside the packed buffer: the checks compute here, so a refused step writes nothing.
        self._scratch_ok = np.zeros(size, dtype=bool)
        self._scratch_pos = np.zeros(size, dtype=np.int32)
        self._scratch_tmp = np.zeros(size, dtype=np.int32)
        self._scratch_idx = np.zeros(size, dtype=np.intp)
        self._arange = np.arange(size, dtype=np.int32)
        # Flat index of request i's token at position p: (p + i * B * bs) // bs = i * B + p // bs.
        # Decode computes it in intp from seq_lens; the general pass in int32 when it fits.
        span = B * bs
        self._row_offset_m1 = np.arange(R, dtype=np.intp) * span - 1  # decode: position = seq_len - 1
        wide = np.dtype(np.intp) if R * span > INT32_MAX else np.dtype(np.int32)
        self._row_offset = np.arange(R, dtype=wide) * span
        self._scratch_u = np.zeros(size, dtype=wide)
        self._scratch_u_reqs = np.zeros(size, dtype=wide)
        if bs & (bs - 1) == 0:
            self._div, self._divisor = np.right_shift, filled(bs.bit_length() - 1, size, np.intp)
            self._divisor_u = filled(bs.bit_length() - 1, size, wide)
        else:
            self._div, self._divisor = np.floor_divide, filled(bs, size, np.intp)
            self._divisor_u = filled(bs, size, wide)
        self._row_mod = np.bitwise_and if span & (span - 1) == 0 else np.remainder
        self._row_span = filled(span - 1 if span & (span - 1) == 0 else span, size, wide)
        self._modulus = filled(bs, size, np.int32)
        # position % block_size: a mask when block_size is a power of two (half the cost)
        power_of_two = bs & (bs - 1) == 0
        self._mod = np.bitwise_and if power_of_two else np.remainder
        self._mod_operand = filled(bs - 1 if power_of_two else bs, size, np.int32)
        self._vocab = None if lim.vocab_size is None else filled(min(lim.vocab_size, INT32_MAX), size, _U32)
        self._max_len = INT32_MAX if lim.max_model_len is None else lim.max_model_len
        self._vocab_size = INT32_MAX + 1 if lim.vocab_size is None else lim.vocab_size
        self._num_blocks = INT32_MAX + 1 if lim.num_blocks is None else lim.num_blocks
        self._block_size = bs
        self._plain = not self.extras
        self._decode_plans: dict[tuple[GraphKey, int], Plan] = {}
        self._plans: dict[tuple[GraphKey, int, int], Plan] = {}

    def _decode_plan(self, key: GraphKey, r: int) -> Plan:
        p = self._plan(key, r, r)
        p.row_offset = self._row_offset_m1[:r]
        content = np.empty(key.num_reqs + 1, dtype=np.int32)
        content[: r + 1] = self._arange[: r + 1]
        content[r + 1 :] = self._qsl_tail(key.num_tokens, key.num_reqs, r, r)
        p.qsl_content = content
        if len(self._decode_plans) >= _MAX_PLANS:
            self._decode_plans.pop(next(iter(self._decode_plans)))
        self._decode_plans[(key, r)] = p
        return p

    def _general_plan(self, key: GraphKey, n: int, r: int) -> Plan:
        p = self._plan(key, n, r)
        p.row_offset = self._row_offset[:r]
        p.u, p.u_reqs = self._scratch_u[:n], self._scratch_u_reqs[:r]
        p.div, p.row_span = self._divisor_u[:n], self._row_span[:n]
        if len(self._plans) >= _MAX_PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[(key, n, r)] = p
        return p

    def _plan(self, key: GraphKey, n: int, r: int) -> Plan:
        T, R = key.num_tokens, key.num_reqs
        views, host, extras, end = self._views_for(key)
        p = Plan()
        p.key, p.T, p.R, p.n, p.r = key, T, R, n, r
        p.inputs = ForwardInputs(*views, n, r, key, host, self.limits, extras)
        p.inputs._broken = self._forget_clean_rows
        p.upload = self._upload_rows(end)
        p.ok, p.ok_r, p.pos = self._scratch_ok[:n], self._scratch_ok[:r], self._scratch_pos[:n]
        p.idx, p.tmp = self._scratch_idx[:n], self._scratch_tmp[:n]
        p.pos_u = p.pos.view(_U32)
        p.ones = filled(1, n)
        p.vocab = None if self._vocab is None else self._vocab[:n]
        p.ids, p.positions, p.slots = self._h_ids[:n], self._h_pos[:n], self._h_slot[:n]
        p.seq, p.table = self._h_seq[:r], self._h_bt[:r]
        p.table_cap = self.block_table.capacity[:r]
        p.null_cap = filled(self._max_len, r, _U32)
        p.div, p.modulus, p.arange = self._divisor[:n], self._modulus[:n], self._arange[:n]
        p.mod_operand = self._mod_operand[:n]
        p.qsl, p.qsl_from_1, p.qsl_real = self._h_qsl[: R + 1], self._h_qsl[1 : r + 1], self._h_qsl[:r]
        p.counts_padded = self.block_table.counts[r:R]
        p.all_true, p.all_true_r = b"\x01" * n, b"\x01" * r
        p.fresh_width, p.fresh_cap = -1, None
        return p

    def _check_ids(self, batch: StepBatch, ids: np.ndarray, p: Plan, n: int) -> None:
        if ids.dtype is _I32:
            if p.vocab is not None:
                _less(ids.view(_U32), p.vocab, out=p.ok)
                if p.ok.tobytes() != p.all_true:
                    self._refuse(batch, p.key)
            elif unsigned_max(ids) > INT32_MAX:
                self._refuse(batch, p.key)
        else:
            top = unsigned_max(ids)
            if top > INT32_MAX or top >= self._vocab_size:
                self._refuse(batch, p.key)

    def _refuse_table_source(self, bt) -> NoReturn:
        """A step that brings its own table (or the null block) while the persistent table holds rows."""
        if bt is not None and type(bt) is not np.ndarray:
            raise BatchError(
                f"block_table is a {type(bt).__name__} that belongs to other buffers; pass this manager's block_table"
            )
        what = "no block table (the null block)" if bt is None else "its own block table"
        raise BatchError(
            f"the step passes {what}, but the persistent block table holds blocks in rows "
            f"0..{self.block_table.top - 1}; pass block_table=<the manager's block_table> (request i reads "
            "row i), or clear its rows first"
        )

    def _fresh_capacity(self, p: Plan, width: int) -> np.ndarray:
        """Tokens a fresh table of `width` columns holds per request, as uint32 (cached per plan)."""
        if p.fresh_width != width:
            p.fresh_width = width
            p.fresh_cap = filled(min(width * self._block_size, self._max_len), p.r, _U32)
        return p.fresh_cap

    def _fresh_slots(self, bt, p: Plan, base: np.ndarray, q) -> int:
        """Stage a fresh table into the rows (or the null block 0) and compute slots; return its width.

        Decode (`q` None): `base` is `seq_lens`; otherwise the general pass left each token's flat
        table index in the plan's scratch (`p.u`).
        """
        r, slots, idx = p.r, p.slots, p.idx
        if bt is None:
            if r:
                p.table[...] = 0  # the null block
                self._mod(p.positions, p.mod_operand, out=slots)
            return self.max_blocks_per_req if r else 0
        width = bt.shape[1]
        if not r:
            return 0
        # memcpy (numpy casts int64 tables). An earlier session saw glibc's `rep movsb` run 10x
        # slow on this VM when the destination sat 1-63 bytes after the source modulo 4 KiB and
        # copied through a ufunc instead (2x slower everywhere); re-measured at every 4-byte
        # offset within +-256 bytes, memcpy showed no slow offset, so it is used. Measure first.
        if width == self.max_blocks_per_req:
            p.table[...] = bt
        else:
            p.table[:, :width] = bt
            if self._dirty_table_cols > width:  # columns an earlier, wider table left
                p.table[:, width : self._dirty_table_cols] = self.limits.pad.block_id
        if q is None:  # decode: flat index of each request's last token
            _add(base, p.row_offset, out=idx)  # seq_len - 1 + row * B * block_size
            self._div(idx, p.div, out=idx)
        else:  # the general pass computed it
            idx = p.u
        self._h_bt_flat.take(idx, out=slots, mode="clip")  # block ids; indices checked above
        np.multiply(slots, p.modulus, out=slots)
        self._mod(p.positions, p.mod_operand, out=p.tmp)
        _add(slots, p.tmp, out=slots)
        return width

    def _refuse(self, batch: StepBatch, key: GraphKey) -> NoReturn:
        refuse_step(batch, key, self.limits, (self.max_num_tokens, self.max_num_reqs), self.block_table)
        refuse_internal(f"{batch!r} into {key}")
