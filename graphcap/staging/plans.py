"""`PlanCache`: per-step plans of the staging passes, their scratch and their constants.

A plan holds everything a step of one `(key, num_tokens, num_reqs)` reuses: views of the
buffers' rows, scratch slices, constant operands (a ufunc given a cached array runs faster
than given a Python int) and the `ForwardInputs` the step returns. Plans are made once per
combination (at most `_MAX_PLANS` of each kind are kept) after the step's counts were
checked against the key, so a cached plan is proof that those counts fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np
import torch

from graphcap._fastnp import filled
from graphcap.block_table import BlockTable
from graphcap.fields import COUNTS_ENTRY, FIELDS, INT32_MAX
from graphcap.inputs import ForwardInputs, HostView, StagingLimits
from graphcap.keys import GraphKey
from graphcap.staging.layout import PackedLayout

__all__ = ["Plan", "PlanCache"]

_U32 = np.dtype(np.uint32)
_MAX_PLANS = 1024
_NO_CAP = np.zeros(0, dtype=_U32)  # the fresh capacity of a plan that saw no fresh table yet


class Plan:
    """Everything a step of `(key, num_tokens, num_reqs)` reuses: views, constants, its `ForwardInputs`."""

    __slots__ = (
        "key", "T", "R", "n", "r", "inputs", "upload", "ok", "ok_r", "pos", "pos_u", "idx", "tmp", "ones", "vocab",
        "ids", "positions", "slots", "seq", "table", "table_cap", "null_cap", "row_offset", "div", "modulus",
        "qsl", "qsl_from_1", "qsl_real", "qsl_content", "counts_padded", "arange", "all_true", "all_true_r",
        "fresh_width", "fresh_cap", "u", "u_reqs", "row_span", "mod_operand", "counts", "count_values",
    )  # fmt: skip
    # Declared for the type checker; the slots above hold them (set by `PlanCache._plan`, then `decode`/`general`).
    key: GraphKey
    T: int
    R: int
    n: int
    r: int
    inputs: ForwardInputs
    upload: tuple[torch.Tensor, torch.Tensor] | None
    ok: np.ndarray
    ok_r: np.ndarray
    pos: np.ndarray
    pos_u: np.ndarray
    idx: np.ndarray
    tmp: np.ndarray
    ones: np.ndarray
    vocab: np.ndarray | None
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq: np.ndarray
    table: np.ndarray
    table_cap: np.ndarray
    null_cap: np.ndarray
    row_offset: np.ndarray
    div: np.ndarray
    modulus: np.ndarray
    qsl: np.ndarray
    qsl_from_1: np.ndarray
    qsl_real: np.ndarray
    qsl_content: np.ndarray
    counts_padded: np.ndarray
    arange: np.ndarray
    all_true: bytes
    all_true_r: bytes
    fresh_width: int
    fresh_cap: np.ndarray  # meaningful once `fresh_width` is a real width
    u: np.ndarray
    u_reqs: np.ndarray
    row_span: np.ndarray
    mod_operand: np.ndarray
    counts: np.ndarray
    count_values: np.ndarray


class PlanCache:
    """Plans by `(key, r)` (decode) and `(key, n, r)` (any step), and the scratch and constants they view.

    The scratch lives outside the packed buffer: the checks compute there, so a refused step
    writes nothing. `div`, `row_mod` and `mod` are the ufuncs the passes divide and reduce
    with (shifts and masks when block sizes are powers of two).
    """

    def __init__(
        self,
        layout: PackedLayout,
        table: BlockTable,
        limits: StagingLimits,
        max_tokens: int,
        max_reqs: int,
        group_views: Callable[[Mapping, Mapping], tuple[Mapping, Mapping]] | None = None,
    ):
        self.layout, self.table, self.limits = layout, table, limits
        self._group_views = group_views  # the `kv_groups` of a ForwardInputs and its HostView (extra KV groups)
        B, bs = limits.max_blocks_per_req, limits.block_size
        R = max_reqs
        size = max(max_tokens, max_reqs) + 1
        host = layout.host
        self.ids, self.positions, self.slots = host["input_ids"], host["positions"], host["slot_mapping"]
        self.seq, self.block_rows, self.qsl = host["seq_lens"], host["block_table"], host["query_start_loc"]
        self.block_rows_flat = self.block_rows.reshape(-1)
        self._scratch_ok = np.zeros(size, dtype=bool)
        self._scratch_pos = np.zeros(size, dtype=np.int32)
        self._scratch_tmp = np.zeros(size, dtype=np.int32)
        self._scratch_idx = np.zeros(size, dtype=np.intp)
        self.arange = np.arange(size, dtype=np.int32)
        # Flat index of request i's token at position p: (p + i * B * bs) // bs = i * B + p // bs.
        # Decode computes it in intp from seq_lens; the general pass in int32 when it fits.
        span = B * bs
        self._row_offset_m1 = np.arange(R, dtype=np.intp) * span - 1  # decode: position = seq_len - 1
        wide = np.dtype(np.intp) if R * span > INT32_MAX else np.dtype(np.int32)
        self._row_offset = np.arange(R, dtype=wide) * span
        self._scratch_u = np.zeros(size, dtype=wide)
        self._scratch_u_reqs = np.zeros(size, dtype=wide)
        self.div: np.ufunc  # block index of a position: a shift when block_size is a power of two
        if bs & (bs - 1) == 0:
            self.div, self._divisor = np.right_shift, filled(bs.bit_length() - 1, size, np.intp)
            self._divisor_u = filled(bs.bit_length() - 1, size, wide)
        else:
            self.div, self._divisor = np.floor_divide, filled(bs, size, np.intp)
            self._divisor_u = filled(bs, size, wide)
        self.row_mod = np.bitwise_and if span & (span - 1) == 0 else np.remainder
        self._row_span = filled(span - 1 if span & (span - 1) == 0 else span, size, wide)
        self._modulus = filled(bs, size, np.int32)
        # position % block_size: a mask when block_size is a power of two (half the cost)
        power_of_two = bs & (bs - 1) == 0
        self.mod = np.bitwise_and if power_of_two else np.remainder
        self._mod_operand = filled(bs - 1 if power_of_two else bs, size, np.int32)
        self._vocab = None if limits.vocab_size is None else filled(min(limits.vocab_size, INT32_MAX), size, _U32)
        self.max_len = INT32_MAX if limits.max_model_len is None else limits.max_model_len
        self.vocab_size = INT32_MAX + 1 if limits.vocab_size is None else limits.vocab_size
        self.num_blocks = INT32_MAX + 1 if limits.num_blocks is None else limits.num_blocks
        self.decode_plans: dict[tuple[GraphKey, int], Plan] = {}
        self.general_plans: dict[tuple[GraphKey, int, int], Plan] = {}

    def set_limits(self, limits: StagingLimits) -> None:
        """New staging limits (a resized KV cache): plans made under the old ones are dropped."""
        self.limits = limits
        self.num_blocks = INT32_MAX + 1 if limits.num_blocks is None else limits.num_blocks
        self.decode_plans.clear()
        self.general_plans.clear()

    def decode(self, key: GraphKey, R: int, r: int, qsl_tail: np.ndarray) -> Plan:
        """A new plan for a decode step of `r` requests (one token each) padded to `(key.num_tokens, R)`."""
        p = self._plan(key, R, r, r)
        p.row_offset = self._row_offset_m1[:r]
        content = np.empty(R + 1, dtype=np.int32)
        content[: r + 1] = self.arange[: r + 1]
        content[r + 1 :] = qsl_tail
        p.qsl_content = content
        if len(self.decode_plans) >= _MAX_PLANS:
            self.decode_plans.pop(next(iter(self.decode_plans)))
        self.decode_plans[(key, r)] = p
        return p

    def general(self, key: GraphKey, R: int, n: int, r: int) -> Plan:
        """The plan (cached) for any step of `n` tokens over `r` requests padded to `(key.num_tokens, R)`."""
        p = self.general_plans.get((key, n, r))
        if p is not None:
            return p
        p = self._plan(key, R, n, r)
        p.row_offset = self._row_offset[:r]
        p.u, p.u_reqs = self._scratch_u[:n], self._scratch_u_reqs[:r]
        p.div, p.row_span = self._divisor_u[:n], self._row_span[:n]
        if len(self.general_plans) >= _MAX_PLANS:
            self.general_plans.pop(next(iter(self.general_plans)))
        self.general_plans[(key, n, r)] = p
        return p

    def fresh_capacity(self, p: Plan, width: int) -> np.ndarray:
        """Tokens a fresh table of `width` columns holds per request, as uint32 (cached per plan)."""
        if p.fresh_width != width:
            p.fresh_width = width
            p.fresh_cap = filled(min(width * self.limits.block_size, self.max_len), p.r, _U32)
        return p.fresh_cap

    def _plan(self, key: GraphKey, R: int, n: int, r: int) -> Plan:
        T = key.num_tokens
        views = self.layout.views(T, R)
        p = Plan()
        p.key, p.T, p.R, p.n, p.r = key, T, R, n, r
        p.inputs = _inputs(views.tensors, views.host, key, n, r, self.limits, self._group_views)
        p.upload = self.layout.rows_for(views.end)
        p.ok, p.ok_r, p.pos = self._scratch_ok[:n], self._scratch_ok[:r], self._scratch_pos[:n]
        p.idx, p.tmp = self._scratch_idx[:n], self._scratch_tmp[:n]
        p.pos_u = p.pos.view(_U32)
        p.ones = filled(1, n)
        p.vocab = None if self._vocab is None else self._vocab[:n]
        p.ids, p.positions, p.slots = self.ids[:n], self.positions[:n], self.slots[:n]
        p.seq, p.table = self.seq[:r], self.block_rows[:r]
        p.table_cap = self.table.capacity[:r]
        p.null_cap = filled(self.max_len, r, _U32)
        p.div, p.modulus, p.arange = self._divisor[:n], self._modulus[:n], self.arange[:n]
        p.mod_operand = self._mod_operand[:n]
        p.qsl, p.qsl_from_1, p.qsl_real = self.qsl[: R + 1], self.qsl[1 : r + 1], self.qsl[:r]
        p.counts_padded = self.table.counts[r:R]
        p.all_true, p.all_true_r = b"\x01" * n, b"\x01" * r
        p.fresh_width, p.fresh_cap = -1, _NO_CAP
        p.counts, p.count_values = views.host[COUNTS_ENTRY], np.array([n, r], dtype=np.int32)
        return p


def _inputs(
    tensors: Mapping, host: Mapping, key: GraphKey, n: int, r: int, limits: StagingLimits, group_views
) -> ForwardInputs:
    """The `ForwardInputs` of one plan, built by keyword from the field table, the engine buffers and the groups."""
    names = [spec.name for spec in limits.extras]
    host_extras = MappingProxyType({name: host[name] for name in names})
    groups, host_groups = group_views(tensors, host) if limits.kv_groups else (MappingProxyType({}),) * 2
    counts = tensors[COUNTS_ENTRY]
    return ForwardInputs(
        **{name: tensors[name] for name in FIELDS},
        num_tokens_device=counts[0],
        num_reqs_device=counts[1],
        num_tokens=n,
        num_reqs=r,
        key=key,
        host=HostView(**{name: host[name] for name in FIELDS}, extras=host_extras, kv_groups=host_groups),
        limits=limits,
        extras=MappingProxyType({name: tensors[name] for name in names}),
        kv_groups=groups,
    )
