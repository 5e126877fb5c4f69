"""Per-step proofs that the invariants hold, in a few numpy calls each (`basic_holds`, `full_holds`).

`graphcap.checks.invariants.check_invariants` runs these first. Each returns True only when every rule
of its level holds; on False the rule-by-rule checks in `graphcap.checks.invariants` run and name the
first broken rule (tests in `test_invariants.py` hold each proof to the checks' verdict on garbage
anywhere in the staged rows). A plan per `ForwardInputs` (staging hands back the same object for
the same key and counts) holds the views, the bytes each padded region must equal, and scratch,
so a step allocates almost nothing. At 256 decodes, at the sizes of `tools/bench_stage.py`:

| proof | numpy calls | the O(T) or O(R B) work |
|---|---|---|
| `basic_holds` | about 9 | byte compares of the padded tails; an unsigned compare of the real slots |
| `full_holds` | about 25 more | an unsigned max over real slots, ids and the key's block table; byte |
| | | compares of positions, slots and padded rows; a gather of each token's block; a sort |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from graphcap._fastnp import ONES_BYTES, amax, amin

if TYPE_CHECKING:  # numpy alone at run time (`graphcap inspect` re-checks without torch)
    from graphcap.inputs import ForwardInputs, HostView, StagingLimits
    from graphcap.keys import GraphKey

__all__ = ["BasicPlan", "FullPlan", "basic_holds", "full_holds", "qsl_tail"]

_less, _subtract = np.less, np.subtract
_add, _equal, _logical_and = np.add, np.equal, np.logical_and
_U32 = np.dtype(np.uint32)
_BOUND = 2**31  # an unknown bound: any int32 read as unsigned below it is non-negative


def basic_holds(inputs: ForwardInputs, *, null_block: bool = True) -> bool:
    """True only when every basic rule holds, in a few numpy calls (the per-step cost).

    `null_block`: also prove that no real token's slot lies in the null block 0 (`slot < block_size`, one
    unsigned comparison of the real slots; a negative slot reads as a huge unsigned value, so the pad slot passes);
    False for graphcap's own batches, whose requests share the null block by design.

    Together the tests below imply every rule `check_invariants` checks one by one (a test in
    `test_invariants.py` holds the two to the same verdict). Each padded region is compared
    byte for byte with the one content its pad rule allows (for a uniform key the whole
    `query_start_loc`, `0, q, 2q, ..., n` then the tail), so every length is right and
    `seq_lens >= lens` is one comparison. The views and expected bytes are built once per
    `ForwardInputs` (staging hands back the same object for the same key and counts). When
    it says False, `check_invariants` names the first broken rule.
    """
    p = inputs.basic_plan
    if (
        p is None
        or p.key is not inputs.key
        or p.n != inputs.num_tokens
        or p.r != inputs.num_reqs
        or p.host is not inputs.host
        or p.limits is not inputs.limits
    ):
        p = BasicPlan.of(inputs)
        if p is None:
            return False
        inputs.basic_plan = p
    if p.uniform:
        if p.qsl.tobytes() != p.qsl_bytes:
            return False
        if _less(p.seq, p.floor, out=p.ok).tobytes() != p.none:
            return False
    else:
        qsl, r = p.qsl, p.r
        if qsl[0] != 0 or qsl[r] != p.n:
            return False
        if r:
            # Non-decreasing from 0 to n, so every entry lies in [0, n]: int32 lengths cannot wrap.
            if _less(p.qsl_hi, p.qsl_lo, out=p.ok).tobytes() != p.none:
                return False
            lens = _subtract(p.qsl_hi, p.qsl_lo, out=p.lens)
            if _less(p.seq, lens, out=p.ok).tobytes() != p.none:
                return False
        if p.qsl_tail is not None and p.qsl_tail.tobytes() != p.qsl_tail_bytes:
            return False
    if p.seq_tail is not None and p.seq_tail.tobytes() != p.seq_tail_bytes:
        return False
    if (
        null_block
        and p.real_slots_u is not None
        and _less(p.real_slots_u, p.block_size, out=p.slot_ok).tobytes() != p.slot_none
    ):
        return False  # a real token writes the null block 0
    return p.slot_tail is None or p.slot_tail.tobytes() == p.slot_tail_bytes


class BasicPlan:
    """What `basic_holds` reads for one `ForwardInputs`: views of its host rows and the bytes they must equal."""

    __slots__ = (
        "key", "n", "r", "host", "limits", "uniform", "qsl", "qsl_bytes", "qsl_hi", "qsl_lo", "qsl_tail",
        "qsl_tail_bytes", "seq", "floor", "ok", "none", "lens", "seq_tail", "seq_tail_bytes", "slot_tail",
        "slot_tail_bytes", "real_slots_u", "block_size", "slot_ok", "slot_none", "full",
    )  # fmt: skip
    # Declared for the type checker; the slots above hold them (set by `of`; `qsl_bytes`, `floor`: a uniform key).
    key: GraphKey
    n: int
    r: int
    host: HostView
    limits: StagingLimits
    uniform: bool
    qsl: np.ndarray
    qsl_bytes: bytes
    qsl_hi: np.ndarray
    qsl_lo: np.ndarray
    qsl_tail: np.ndarray | None
    qsl_tail_bytes: bytes
    seq: np.ndarray
    floor: np.ndarray
    ok: np.ndarray
    none: bytes
    lens: np.ndarray
    seq_tail: np.ndarray | None
    seq_tail_bytes: bytes
    slot_tail: np.ndarray | None
    slot_tail_bytes: bytes
    real_slots_u: np.ndarray | None
    block_size: np.uint32
    slot_ok: np.ndarray
    slot_none: bytes
    full: FullPlan | None

    @classmethod
    def of(cls, inputs: ForwardInputs) -> BasicPlan | None:
        """The plan, or None when the counts do not fit the key (`check_invariants` names that)."""
        host, key, pad = inputs.host, inputs.key, inputs.limits.pad
        n, r = inputs.num_tokens, inputs.num_reqs
        T, R = len(host.input_ids), len(host.seq_lens)  # the padded counts (a piecewise key: the step's own)
        if not (0 <= n <= T and 0 <= r <= R) or host.query_start_loc.dtype != np.int32:
            return None
        p = cls()
        p.key, p.n, p.r, p.host, p.limits = key, n, r, host, inputs.limits
        p.qsl, p.seq = host.query_start_loc, host.seq_lens[:r]
        tail = qsl_tail(T, R, n, r, pad.query_len).astype(np.int32)
        p.uniform = bool(key.uniform and r)
        if p.uniform:
            q = T // R
            if n != r * q:
                return None  # a uniform key's real requests have q tokens each: broken, and named slowly
            p.qsl_bytes = (q * np.arange(r + 1, dtype=np.int32)).tobytes() + tail.tobytes()
            p.floor = np.full(r, q, dtype=np.int32)
        p.qsl_hi, p.qsl_lo = host.query_start_loc[1 : r + 1], host.query_start_loc[:r]
        p.qsl_tail = host.query_start_loc[r + 1 :] if r < R else None
        p.qsl_tail_bytes = tail.tobytes()
        p.ok, p.none = np.empty(r, dtype=bool), bytes(r)
        p.lens = np.empty(r, dtype=np.int32)
        p.seq_tail = host.seq_lens[r:] if r < R else None
        p.seq_tail_bytes = np.full(R - r, pad.seq_len, dtype=host.seq_lens.dtype).tobytes()
        p.slot_tail = host.slot_mapping[n:] if n < T else None
        p.slot_tail_bytes = np.full(T - n, pad.slot, dtype=host.slot_mapping.dtype).tobytes()
        real = host.slot_mapping[:n]
        p.real_slots_u = real.view(_U32) if n and real.dtype == np.int32 else None
        p.block_size = np.uint32(inputs.limits.block_size)  # a numpy scalar: no conversion per call
        p.slot_ok, p.slot_none = np.empty(n, dtype=bool), bytes(n)
        p.full = None  # built by the first `full_holds`
        return p


def full_holds(inputs: ForwardInputs, kv_writes: bool = True, dummy: bool = False) -> bool:
    """True only when every `full` rule holds; call it only after `basic_holds(inputs)` said True.

    Ranges are one unsigned max each (a negative reads as a huge unsigned value); positions are
    `seq_len - query_len + offset`, compared byte for byte (a decode step's are `seq_lens - 1`);
    each real token's slot is its own request's block at its position (one gather); the null
    block written, the null block read (a mask over the real rows' used columns) and a slot
    written twice are a min, three array ops and a sort. When it says False, `_check_full` and
    `_check_kv_writes` name the broken rule (or find none: False is allowed to be cautious).
    """
    b = inputs.basic_plan
    if b is None:  # `basic_holds` did not run (or found no plan): cautious
        return False
    f = b.full
    if f is None:
        f = b.full = FullPlan.of(inputs, b)
        if f is None:
            return False
    if f.table_u is not None and amax(f.table_u) >= f.block_bound:
        return False
    if f.table_tail is not None and f.table_tail.tobytes() != f.table_tail_bytes:
        return False
    if f.pos_tail is not None and (
        f.pos_tail.tobytes() != f.pos_tail_bytes or f.ids_tail.tobytes() != f.ids_tail_bytes
    ):
        return False
    n = f.n
    if not n:
        return True
    if amax(f.ids_u) >= f.vocab_bound:
        return False
    slots = f.slots
    if kv_writes:
        if amax(f.slots_u) >= f.slot_bound:
            return False
    elif slots.tobytes() != f.pad_slots:
        return False
    seq = f.seq
    if amax(seq) > f.max_model_len:  # also keeps the int32 arithmetic below from wrapping
        return False
    # positions == seq_len - query_len + offset within the request
    lens: int | np.ndarray
    if f.uniform_len:
        lens, ones = f.uniform_len, f.uniform_len == 1
    else:
        lens = b.lens
        ones = n == f.r and ONES_BYTES.startswith(lens.tobytes())
    context = _subtract(seq, lens, out=f.context)
    if ones:  # one token per request: its position is its context length
        expected = context
    else:
        expected = np.repeat(_subtract(context, f.starts, out=f.shift), lens)
        _add(expected, f.offsets, out=expected)
    if expected.tobytes() != f.positions.tobytes():
        return False
    if not kv_writes:
        return True
    # positions now lie in [0, max_model_len); the block table's columns reach past them unless:
    if f.width is not None and amax(f.positions) >= f.width:
        return False
    rows = f.row_starts[:n] if ones else np.repeat(f.row_starts[: f.r], lens)  # request * columns
    columns = f.divide(f.positions, f.divisor, out=f.index)  # the block-table column of each position
    blocks = f.table.take(_add(rows, columns, out=f.index), out=f.blocks)
    expected = f.modulo(f.positions, f.modulus, out=f.expected)  # the offset within the block
    _add(expected, np.multiply(blocks, f.block_size, out=f.scratch), out=expected)
    if expected.tobytes() != slots.tobytes():
        return False
    if dummy:
        return True
    if amin(blocks) == 0:  # a real request writing the null block
        return False
    if f.r:  # a real request reading the null block: a 0 in the columns its seq_len covers
        used = f.divide(_add(seq, f.block_size - 1, out=f.need), f.divisor, out=f.need)  # ceil(seq / bs)
        reads = _less(f.columns, used[:, None], out=f.mask)
        if _logical_and(reads, _equal(f.table_rows, 0, out=f.zero), out=f.mask).any():
            return False
    ordered = slots.copy()
    ordered.sort()
    return _equal(ordered[1:], ordered[:-1], out=f.same).tobytes() == f.none


class FullPlan:
    """What `full_holds` reads for one `ForwardInputs`: views, the bytes padded rows must equal, scratch."""

    __slots__ = (
        "n", "r", "slots", "slots_u", "slot_bound", "pad_slots", "ids_u", "vocab_bound", "seq", "starts",
        "positions", "offsets", "context", "shift", "uniform_len", "max_model_len", "width", "pos_tail",
        "pos_tail_bytes", "ids_tail", "ids_tail_bytes", "table", "table_u", "block_bound", "table_tail",
        "table_tail_bytes", "row_starts", "block_size", "divide", "divisor", "modulo", "modulus", "index",
        "blocks", "expected", "scratch", "same", "none", "need", "columns", "table_rows", "mask", "zero",
    )  # fmt: skip
    # Declared for the type checker; the slots above hold them (set by `of`).
    n: int
    r: int
    slots: np.ndarray
    slots_u: np.ndarray
    slot_bound: int
    pad_slots: bytes
    ids_u: np.ndarray
    vocab_bound: int
    seq: np.ndarray
    starts: np.ndarray
    positions: np.ndarray
    offsets: np.ndarray
    context: np.ndarray
    shift: np.ndarray
    uniform_len: int
    max_model_len: int
    width: int | None
    pos_tail: np.ndarray | None
    pos_tail_bytes: bytes
    ids_tail: np.ndarray
    ids_tail_bytes: bytes
    table: np.ndarray
    table_u: np.ndarray | None
    block_bound: int
    table_tail: np.ndarray | None
    table_tail_bytes: bytes
    row_starts: np.ndarray
    block_size: int
    divide: np.ufunc
    divisor: int
    modulo: np.ufunc
    modulus: int
    index: np.ndarray
    blocks: np.ndarray
    expected: np.ndarray
    scratch: np.ndarray
    same: np.ndarray
    none: bytes
    need: np.ndarray
    columns: np.ndarray
    table_rows: np.ndarray
    mask: np.ndarray
    zero: np.ndarray

    @classmethod
    def of(cls, inputs: ForwardInputs, basic: BasicPlan) -> FullPlan | None:
        """The plan, or None where the proof does not apply (the rule-by-rule checks run instead)."""
        host, lim = inputs.host, inputs.limits
        pad, n, r = lim.pad, basic.n, basic.r
        T, R = len(host.input_ids), len(host.seq_lens)
        table = host.block_table  # [R, B]
        arrays = (host.input_ids, host.positions, host.slot_mapping, host.seq_lens, table)
        if lim.max_model_len is None or lim.num_blocks is None or table.ndim != 2 or not table.flags.c_contiguous:
            return None
        if any(a.dtype != np.int32 for a in arrays) or lim.num_blocks * lim.block_size > _BOUND:
            return None
        f = cls()
        f.n, f.r, B, bs = n, r, table.shape[1], lim.block_size
        f.slots, f.seq, f.starts = host.slot_mapping[:n], host.seq_lens[:r], host.query_start_loc[:r]
        f.positions, f.offsets = host.positions[:n], np.arange(n, dtype=np.int32)
        f.slots_u, f.ids_u = f.slots.view(_U32), host.input_ids[:n].view(_U32)
        f.slot_bound, f.vocab_bound = lim.num_blocks * bs, lim.vocab_size or _BOUND
        f.pad_slots = np.full(n, pad.slot, dtype=np.int32).tobytes()
        f.context, f.shift = np.empty(r, dtype=np.int32), np.empty(r, dtype=np.int32)
        f.uniform_len = T // R if basic.uniform else 0
        f.max_model_len = lim.max_model_len
        f.width = B * bs if B * bs < lim.max_model_len else None
        f.pos_tail = host.positions[n:] if n < T else None
        f.pos_tail_bytes = np.full(T - n, pad.position, dtype=np.int32).tobytes()
        f.ids_tail = host.input_ids[n:]
        f.ids_tail_bytes = np.full(T - n, pad.token_id, dtype=np.int32).tobytes()
        f.table = table.reshape(-1)
        f.table_u = f.table.view(_U32) if table.size else None
        f.block_bound = lim.num_blocks
        f.table_tail = table[r:] if r < R else None
        f.table_tail_bytes = np.full((R - r) * B, pad.block_id, dtype=np.int32).tobytes()
        f.row_starts = np.arange(R, dtype=np.int32) * B
        f.block_size = bs
        if bs & (bs - 1) == 0:  # a power of two: shift and mask
            f.divide, f.divisor, f.modulo, f.modulus = np.right_shift, bs.bit_length() - 1, np.bitwise_and, bs - 1
        else:
            f.divide, f.divisor, f.modulo, f.modulus = np.floor_divide, bs, np.remainder, bs
        f.index, f.blocks, f.expected, f.scratch = (np.empty(n, dtype=np.int32) for _ in range(4))
        f.same, f.none = np.empty(max(n - 1, 0), dtype=bool), bytes(max(n - 1, 0))
        f.need, f.columns, f.table_rows = np.empty(r, dtype=np.int32), np.arange(B, dtype=np.int32), table[:r]
        f.mask, f.zero = np.empty((r, B), dtype=bool), np.empty((r, B), dtype=bool)
        return f


def qsl_tail(T: int, R: int, n: int, r: int, pad_query_len: int) -> np.ndarray:
    """The padded `query_start_loc[r+1 : R+1]` (written independently of `PadWriter.qsl_tail`, same arguments)."""
    steps = np.arange(1, R - r + 1)
    return np.minimum(n + pad_query_len * steps, T) if pad_query_len else np.full(R - r, n)
