"""`StepBatch` (one scheduler step, host side), and the batches graphcap makes to capture and verify a key.

A `StepBatch` is what a scheduler hands the model runner: per-request query lengths (the
tokens computed this step) and total sequence lengths, optionally the token ids and the
block table (an array, or the rows of a persistent `BlockTable`). Building one costs a few
microseconds whatever its size: the value checks run in `PersistentBuffers.stage`, folded
into the pass that stages the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from graphcap._fastnp import ONES_BYTES, amax, amin, ones, unsigned_max
from graphcap.block_table import BlockTable
from graphcap.errors import BatchError
from graphcap.fields import INT32_MAX
from graphcap.keys import GraphKey

__all__ = [
    "Probe",
    "StepBatch",
    "check_block_ids",
    "check_seq_lens",
    "check_token_ids",
    "distinct_blocks",
    "dummy_batch",
    "probe_batch",
    "scratch_block_ids",
]

_NO_EXTRAS: Mapping[str, np.ndarray] = MappingProxyType({})
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


class StepBatch:
    """One step as the scheduler sees it: request lengths, token ids and where the blocks are.

    `query_lens[i]`: tokens of request i computed this step (>= 1).
    `seq_lens[i]`: total length of request i *including* this step's tokens (>= query_lens[i]).
    `input_ids`: `sum(query_lens)` token ids in request order, or None (all token 0).
    `block_table`: where each request's KV-cache blocks are, one of
      - a 2-D array, `block_table[i, j]` the j-th block of request i, with at least
        `ceil(seq_lens[i] / block_size)` columns (a fresh table: copied and checked every step);
      - the manager's persistent `BlockTable` (`CaptureManager.block_table`): request i reads
        row i, which the engine keeps with `set_row`/`append`/`move`/`clear` (checked at write;
        the step neither copies nor scans it);
      - None: every request uses the null block 0 (dummy runs).
    `extras`: real rows of the engine's own buffers (`BufferSpec`), by name.

    Construction checks what dispatch needs: shapes, lengths and `query_lens` (kept as a
    read-only copy, or a shared constant for a decode step, so `num_tokens` and uniformity
    cannot change after dispatch). The values of `seq_lens`, `input_ids` and `block_table`
    are checked by `PersistentBuffers.stage` in the same pass that stages them, before it
    writes anything: what was checked is what is staged. Native int32/int64 arrays are
    referenced, not copied: an engine that changes one before staging stages (or is refused
    for) the changed values. Anything else (lists, other dtypes, byte orders) is converted
    into a read-only array the batch owns, and its values are checked here as well.
    Refusals raise `BatchError` (a `ValueError`) naming the field, the index and the value.
    """

    __slots__ = (
        "query_lens",
        "seq_lens",
        "input_ids",
        "block_table",
        "num_reqs",
        "num_tokens",
        "min_query_len",
        "max_query_len",
        "extras",
    )

    def __init__(self, query_lens, seq_lens, input_ids=None, block_table=None, *, extras=None) -> None:
        # Hot path (every step): a decode step's int32 query_lens is one memcmp against a shared
        # row of ones; the other arrays are taken by reference (no copy, no scan: stage does both).
        q = query_lens
        if type(q) is np.ndarray and q.dtype is _I32 and q.ndim == 1 and q.size and ONES_BYTES.startswith(q.tobytes()):
            num_reqs = num_tokens = len(q)
            q_min = q_max = 1
            q = ones(num_reqs)
        else:
            q, q_min, q_max, num_tokens = _query_lens(q)
            num_reqs = len(q)
        s = seq_lens
        if type(s) is not np.ndarray or s.ndim != 1 or (s.dtype is not _I32 and s.dtype is not _I64):
            s = _converted(s, "seq_lens", 1)
            if len(s) == num_reqs:
                check_seq_lens(q, s)
                s = _owned_int32(s)
        if len(s) != num_reqs:
            raise BatchError(
                f"seq_lens has {len(s)} entries but query_lens has {num_reqs}; give one entry per request in both"
            )
        ids = input_ids
        if ids is not None:
            if type(ids) is not np.ndarray or ids.ndim != 1 or (ids.dtype is not _I32 and ids.dtype is not _I64):
                ids = _converted(ids, "input_ids", 1)
                check_token_ids(ids)
                ids = _owned_int32(ids)
            if len(ids) != num_tokens:
                raise BatchError(
                    f"input_ids has {len(ids)} entries but query_lens sum to {num_tokens}; "
                    "give one token id per computed token, in request order"
                )
        bt = block_table
        if bt is not None and not isinstance(bt, BlockTable):
            if type(bt) is not np.ndarray or bt.ndim != 2 or (bt.dtype is not _I32 and bt.dtype is not _I64):
                bt = _converted(bt, "block_table", 2)
                check_block_ids(bt)
                bt = _owned_int32(bt)
            if bt.shape[0] != num_reqs:
                raise BatchError(
                    f"block_table has {bt.shape[0]} rows but the batch has {num_reqs} requests; "
                    "give one row per request"
                )
        self.query_lens = q
        self.seq_lens = s
        self.input_ids = ids
        self.block_table = bt
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        self.min_query_len = q_min
        self.max_query_len = q_max
        self.extras = _NO_EXTRAS if not extras else _owned_extras(extras)

    def is_uniform(self, query_len: int) -> bool:
        """True when every request has exactly `query_len` tokens (an empty batch is uniform)."""
        return self.num_reqs == 0 or self.min_query_len == self.max_query_len == query_len

    @property
    def max_seq_len(self) -> int:
        """The longest `seq_lens` entry (0 without requests); computed on each call."""
        return int(amax(self.seq_lens)) if self.num_reqs else 0

    @property
    def max_token_id(self) -> int:
        """The largest token id, -1 without ids; computed on each call."""
        ids = self.input_ids
        return int(amax(ids)) if ids is not None and len(ids) else -1

    @property
    def max_block_id(self) -> int:
        """The largest block id of a fresh table, -1 without one; computed on each call."""
        bt = self.block_table
        return int(amax(bt.ravel())) if isinstance(bt, np.ndarray) and bt.size else -1

    def __repr__(self) -> str:
        return (
            f"StepBatch(num_reqs={self.num_reqs}, num_tokens={self.num_tokens}, "
            f"query_lens={_short(self.query_lens)}, seq_lens={_short(self.seq_lens)})"
        )


def dummy_batch(key: GraphKey, *, max_model_len: int | None = None) -> StepBatch:
    """A batch that fills `key` the way capture needs, with the null block table.

    Uniform key: `key.num_reqs` requests of `T / R` tokens each. Mixed key: all `T` tokens
    spread over fewer requests than `R` (when `R > 1`), so the padded requests of the
    founding bug exist during capture. `max_model_len` caps each request's length.
    """
    T, R = key.num_tokens, key.num_reqs
    if key.uniform:
        if T % R:
            raise BatchError(f"uniform {key} must have num_tokens divisible by num_reqs")
        q = np.full(R, T // R, dtype=np.int32)
    else:
        limit = max_model_len or T
        num_real = max(1, R // 2, -(-T // limit))
        if num_real > R or num_real > T:
            raise BatchError(f"{key} cannot hold {T} tokens in requests of at most {limit}")
        q = np.full(num_real, T // num_real, dtype=np.int32)
        q[: T % num_real] += 1
    return StepBatch(q, q.copy())


class Probe(NamedTuple):
    """A verification batch and whether its real tokens may write the KV cache."""

    batch: StepBatch
    writes_kv: bool
    """True: every real token writes its own slot, in a block the engine named scratch; False: the
    block table reads live blocks, and staging gives every real token the pad slot (no KV write)."""


def probe_batch(
    key: GraphKey,
    *,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    seed: int = 0,
    scratch_blocks: Sequence[int] = (),
) -> Probe:
    """A second verification batch for `key`: partly filled, unlike the dummy batch in every value.

    Fewer real requests than `R` wherever the key allows, so padded rows exist, and for mixed keys
    fewer tokens than `T` (from `T = 3`) over fewer requests than tokens (an output with a row per
    request cut as per token shows); random token ids, context lengths and block tables. A graph
    that froze a host value at capture (a Python count, a value read from the host metadata) or
    lets padded rows leak into real ones gives different real rows than an eager run of this batch.

    The probe never writes a KV block that may hold a live request's keys: its context reads
    random blocks (from 1 up, never the null block), and the blocks its tokens are computed in
    come from `scratch_blocks` (blocks the engine says are free) when there are enough of them,
    one slot per token (`writes_kv`). Otherwise those tokens must write nothing: the caller
    stages them with the pad slot (`writes_kv` False).
    """
    rng = np.random.default_rng([seed, key.num_tokens, key.num_reqs, int(key.uniform)])
    T, R = key.num_tokens, key.num_reqs
    if key.uniform:
        q_len = T // R
        q = np.full(max(1, R - 1), q_len, dtype=np.int64)
    else:
        num_tokens = T - max(1, T // 4) if T > 2 else T
        num_reqs = min(max(1, R - max(1, R // 3)), max(1, num_tokens // 2)) if R > 1 else 1
        num_reqs = max(num_reqs, -(-num_tokens // max_model_len))
        num_tokens = min(num_tokens, num_reqs * max_model_len)
        q = np.ones(num_reqs, dtype=np.int64)
        extra = rng.integers(0, num_reqs, num_tokens - num_reqs)
        np.add.at(q, extra, 1)
        while q.max() > max_model_len:  # move tokens of an over-long request to the shortest one
            q[int(np.argmax(q))] -= 1
            q[int(np.argmin(q))] += 1
    context = rng.integers(0, np.maximum(1, max_model_len - q + 1))
    if (-(-(context + q) // block_size)).sum() > num_blocks - 1:  # too few blocks for random context
        context[:] = 0
    blocks = distinct_blocks(q + context, block_size, num_blocks, rng)
    # The columns each request's computed tokens fall in: [first, last) per request.
    first, last = context // block_size, -(-(context + q) // block_size)
    scratch = np.unique(np.asarray(scratch_blocks, dtype=np.int64))
    writes = bool(scratch.size) and int((last - first).sum()) <= scratch.size
    if writes:
        taken = iter(rng.permutation(scratch).tolist())
        for i in range(len(q)):
            for j in range(int(first[i]), int(last[i])):
                blocks[i, j] = next(taken)
    ids = rng.integers(0, vocab_size, int(q.sum()))
    return Probe(StepBatch(q, q + context, ids, blocks), writes)


def scratch_block_ids(blocks: Any, num_blocks: int) -> tuple[int, ...]:
    """`blocks` (an engine's free block ids, given as `capture(scratch_blocks=...)`) checked and as ints.

    `TypeError` for anything but a collection of integers; `ValueError` naming a block outside
    `[1, num_blocks)` (block 0 is the null block, which capture writes anyway).
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
        raise TypeError(f"scratch_blocks must be a list of block ids; got {type(blocks).__name__}")
    out = []
    for block in blocks:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 1 <= block < num_blocks:
            raise ValueError(
                f"scratch_blocks holds {block!r}; scratch blocks are ids of free KV-cache blocks in "
                f"[1, {num_blocks}) (kv_cache.num_blocks; block 0 is the null block, written anyway)"
            )
        out.append(int(block))
    return tuple(out)


def distinct_blocks(seq_lens: np.ndarray, block_size: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """A block table giving every request its own blocks (random, never the null block 0).

    Request i gets `ceil(seq_lens[i] / block_size)` blocks, so no two tokens share a KV slot.
    When the cache has fewer blocks than that in all, blocks are reused from the start (a test
    batch on a tiny cache; its slots may then collide).
    """
    need = -(-np.asarray(seq_lens, dtype=np.int64) // block_size)
    usable = num_blocks - 1
    table = np.zeros((len(need), max(1, int(need.max(initial=1)))), dtype=np.int64)
    order = rng.permutation(usable) + 1
    start = 0
    for i, count in enumerate(need.tolist()):
        taken = order[start : start + count] if start + count <= usable else order[:count]
        table[i, :count] = taken
        start += count
    return table


def check_seq_lens(q: np.ndarray, s: np.ndarray) -> None:
    """`seq_lens` within int32 and `>= query_lens` (both 1-D, same length, `q >= 1`)."""
    if not len(s):
        return
    if unsigned_max(s) > INT32_MAX and amax(s) > INT32_MAX:  # a negative is named against its query_len
        i = int(np.argmax(s))
        raise BatchError(f"seq_lens[{i}] is {int(s[i])}, above the int32 range of the buffers")
    below = s < q
    if not below.any():
        return
    i = int(np.argmax(below))
    raise BatchError(
        f"seq_lens[{i}] is {int(s[i])} but query_lens[{i}] is {int(q[i])}; seq_lens count every token "
        "of the request including this step's, so seq_lens >= query_lens"
    )


def check_token_ids(ids: np.ndarray) -> None:
    """Token ids within int32 and `>= 0`."""
    if unsigned_max(ids) > INT32_MAX:
        _check_int32(ids, "input_ids")
        t = int(np.argmax(ids < 0))
        raise BatchError(f"input_ids[{t}] is {int(ids[t])}; token ids are >= 0")


def check_block_ids(table: np.ndarray) -> None:
    """Block ids within int32 and `>= 0`."""
    if unsigned_max(table) > INT32_MAX:
        _check_int32(table, "block_table")
        i, j = np.argwhere(table < 0)[0]
        raise BatchError(f"block_table[{i}, {j}] is {int(table[i, j])}; block ids are >= 0")


def _check_int32(array: np.ndarray, name: str) -> None:
    top = int(amax(array.ravel()))
    if top > INT32_MAX:
        raise BatchError(f"{name} holds {top}, above the int32 range of the buffers")


def _query_lens(values) -> tuple[np.ndarray, int, int, int]:
    """`(query_lens as a read-only int32 array the batch owns, min, max, sum)`, each checked."""
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype is _I32 and len(values):
        q = values.copy()  # ours: the caller may reuse its array; num_tokens must stay true
        q_min, q_max = int(amin(q)), int(amax(q))
        if q_min >= 1:
            q.flags.writeable = False
            return q, q_min, q_max, int(np.add.reduce(q, dtype=_I64))
    else:
        q = _converted(values, "query_lens", 1)
        if not len(q):
            return _owned_int32(q), 0, 0, 0
        q_min, q_max = int(amin(q)), int(amax(q))
    if q_min < 1:
        i = int(np.argmax(q < 1))
        raise BatchError(
            f"query_lens[{i}] is {int(q[i])}; every scheduled request computes at "
            "least one token: drop requests with nothing to compute from the step"
        )
    if q_max > INT32_MAX:
        raise BatchError(f"query_lens holds {q_max}, above the int32 range of the buffers")
    q = _owned_int32(q)
    return q, q_min, q_max, int(np.add.reduce(q, dtype=_I64))


def _converted(values, name: str, ndim: int) -> np.ndarray:
    """`values` as a new native integer numpy array (int64 or int32), shape-checked; values not yet range-checked."""
    if isinstance(values, np.ndarray):
        array = values.copy()  # ours: the caller may reuse its own array for the next step
    else:
        try:
            array = np.asarray(values)
        except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, odd objects
            raise BatchError(f"{name} must be a {ndim}-D array of integers; {exc}") from None
    if array.ndim != ndim:
        if not (array.size == 0 and ndim == 2):
            raise BatchError(f"{name} must be {ndim}-D; got shape {tuple(array.shape)}")
        array = array.reshape(0, 0)
    if array.dtype.kind not in "iu":
        if array.size != 0:
            raise BatchError(f"{name} must hold integers; got dtype {array.dtype}")
        return array.astype(np.int64)  # np.asarray([]) is float64
    if array.dtype.kind == "u" and array.itemsize >= 4:
        # uint32/uint64 hold values int32 cannot; with int32 arithmetic uint64 even promotes to
        # float64. Refuse values above int32 here and keep the rest exactly as int64.
        if array.size and int(amax(array.ravel())) > INT32_MAX:
            raise BatchError(f"{name} holds {int(amax(array.ravel()))}, above the int32 range of the buffers")
        return array.astype(np.int64)
    # int8/int16 widen (read as unsigned, -1 would pass as 255); byte-swapped become native.
    return array.astype(np.int64 if array.itemsize == 8 else np.int32)


def _owned_int32(array: np.ndarray) -> np.ndarray:
    """A read-only int32 array of `array`'s values (already checked to fit)."""
    out = array.astype(np.int32, copy=array.dtype != _I32)
    out.flags.writeable = False
    return out


def _owned_extras(extras: Any) -> Mapping[str, np.ndarray]:
    if not isinstance(extras, Mapping):
        raise BatchError(f"extras must map buffer names to arrays; got {type(extras).__name__}")
    out = {}
    for name, values in extras.items():
        try:
            array = np.array(values, copy=True)
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchError(f"extras[{name!r}] must be an array of numbers; {exc}") from None
        if array.dtype.kind not in "biuf":
            raise BatchError(f"extras[{name!r}] must hold numbers or booleans; got dtype {array.dtype}")
        array.flags.writeable = False
        out[name] = array
    return MappingProxyType(out)


def _short(array: np.ndarray) -> str:
    items = array.tolist()
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
