"""`StepBatch` (one scheduler step, host side), `GraphKey`, and dummy batches for capture.

A `StepBatch` is what a scheduler hands the model runner: per-request query lengths (the
tokens computed this step) and total sequence lengths, optionally the token ids and the
block table. It validates itself on construction with vectorized numpy, so an engine that
already keeps numpy arrays pays no per-request Python loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, NoReturn

import numpy as np

from graphcap._fastnp import INT32_MAX, amax, amin, is_filled, unsigned_max
from graphcap.errors import BatchError

__all__ = ["GraphKey", "StepBatch", "distinct_blocks", "dummy_batch", "probe_batch"]

_NO_EXTRAS: Mapping[str, np.ndarray] = MappingProxyType({})


class GraphKey(NamedTuple):
    """Identity of one captured graph; the manager's registry is the only place keys are made.

    Fields: `num_tokens` - padded token count T (a captured size); `num_reqs` - padded
    request count R (rows of `query_start_loc[:R+1]`, `seq_lens`, `block_table`);
    `uniform` - every real request has exactly `T / R` tokens (a decode or spec-decode step),
    which attention backends may exploit.
    """

    num_tokens: int
    num_reqs: int
    uniform: bool

    def __str__(self) -> str:
        kind = "uniform" if self.uniform else "mixed"
        return f"{kind}(tokens={self.num_tokens}, reqs={self.num_reqs})"


class StepBatch:
    """One step as the scheduler sees it. Validated on construction; read-only afterwards.

    `query_lens[i]`: tokens of request i computed this step (>= 1).
    `seq_lens[i]`: total length of request i *including* this step's tokens (>= query_lens[i]).
    `input_ids`: `sum(query_lens)` token ids in request order, or None (all token 0).
    `block_table[i, j]`: KV-cache block of request i's j-th block; needs
    `ceil(seq_lens[i] / block_size)` columns. None: every request uses the null block 0
    (dummy runs). Bounds that need the cache geometry are checked by
    `PersistentBuffers.stage`, before it writes anything.

    `extras`: real rows of the engine's own buffers (`BufferSpec`), by name; their shape,
    dtype and values are checked by `PersistentBuffers.stage`, before it writes anything.

    The batch owns its arrays: each is copied on construction and made read-only, so what
    was validated is what gets staged, whatever the caller does with its own arrays later.
    Refusals raise `BatchError` (a `ValueError`) naming the field, the index and the value.
    Derived on construction: `num_reqs`, `num_tokens`, `min_query_len`, `max_query_len`,
    `max_seq_len`, `max_token_id` and `max_block_id` (-1 when there are no ids or blocks).
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
        "max_seq_len",
        "max_token_id",
        "max_block_id",
        "extras",
    )

    def __init__(self, query_lens, seq_lens, input_ids=None, block_table=None, *, extras=None) -> None:
        # Hot path (every step): a handful of numpy reductions, no per-request Python. The
        # maxima found here (`max_seq_len`, `max_token_id`, `max_block_id`) are kept so
        # `PersistentBuffers.stage` checks its bounds without scanning the arrays again.
        q = _int_array(query_lens, "query_lens", 1)
        s = _int_array(seq_lens, "seq_lens", 1)
        num_reqs = len(q)
        if len(s) != num_reqs:
            raise BatchError(
                f"seq_lens has {len(s)} entries but query_lens has {num_reqs}; give one entry per request in both"
            )
        if num_reqs:
            if is_filled(q, 1):  # pure decode, the hot step: one memcmp, not two reductions
                q_min = q_max = 1
            else:
                q_min = int(amin(q))
                if q_min < 1:
                    i = int(np.argmax(q < 1))
                    raise BatchError(
                        f"query_lens[{i}] is {int(q[i])}; every scheduled request computes at "
                        "least one token: drop requests with nothing to compute from the step"
                    )
                q_max = int(amax(q))
            if q_max == 1:
                # Pure decode: seq_lens >= query_lens is seq_lens >= 1, i.e. no entry negative
                # (read as unsigned, a negative exceeds int32) and none zero.
                max_seq_len = unsigned_max(s)
                if max_seq_len > INT32_MAX or np.count_nonzero(s) != num_reqs:
                    _refuse_seq_lens(q, s)
            else:
                max_seq_len = int(amax(s))
                if max_seq_len > INT32_MAX or np.less(s, q).any():
                    _refuse_seq_lens(q, s)
            num_tokens = num_reqs if q_max == 1 else int(q.sum())
        else:
            q_min = q_max = max_seq_len = 0
            num_tokens = 0
        max_token_id = max_block_id = -1
        if input_ids is not None:
            input_ids = _int_array(input_ids, "input_ids", 1)
            # One reduction finds negatives and values above int32 together: viewed as
            # unsigned, a negative id is larger than any id the buffers can hold.
            max_token_id = unsigned_max(input_ids)
            if max_token_id > INT32_MAX:
                _check_int32(input_ids, "input_ids")
            if len(input_ids) != num_tokens:
                raise BatchError(
                    f"input_ids has {len(input_ids)} entries but query_lens sum to {num_tokens}; "
                    "give one token id per computed token, in request order"
                )
            if max_token_id > INT32_MAX:
                t = int(np.argmax(input_ids < 0))
                raise BatchError(f"input_ids[{t}] is {int(input_ids[t])}; token ids are >= 0")
        if block_table is not None:
            block_table = _int_array(block_table, "block_table", 2)
            max_block_id = unsigned_max(block_table)
            if max_block_id > INT32_MAX:
                _check_int32(block_table, "block_table")
            if block_table.shape[0] != num_reqs:
                raise BatchError(
                    f"block_table has {block_table.shape[0]} rows but the batch has {num_reqs} "
                    "requests; give one row per request"
                )
            if max_block_id > INT32_MAX:
                i, j = np.argwhere(block_table < 0)[0]
                raise BatchError(f"block_table[{i}, {j}] is {int(block_table[i, j])}; block ids are >= 0")
        self.query_lens = q
        self.seq_lens = s
        self.input_ids = input_ids
        self.block_table = block_table
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        self.min_query_len = q_min
        self.max_query_len = q_max
        self.max_seq_len = max_seq_len
        self.max_token_id = max_token_id
        self.max_block_id = max_block_id
        self.extras = _NO_EXTRAS if not extras else _owned_extras(extras)

    def is_uniform(self, query_len: int) -> bool:
        """True when every request has exactly `query_len` tokens (an empty batch is uniform)."""
        return self.num_reqs == 0 or self.min_query_len == self.max_query_len == query_len

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


def probe_batch(
    key: GraphKey, *, max_model_len: int, block_size: int, num_blocks: int, vocab_size: int, seed: int = 0
) -> StepBatch:
    """A second verification batch for `key`: partly filled, unlike the dummy batch in every value.

    Fewer real requests than `R` (and fewer tokens than `T`, for mixed keys) wherever the key
    allows, so padded rows exist; random token ids, context lengths and block tables. A graph
    that froze a host value at capture (a Python count, a value read from the host metadata)
    or lets padded rows leak into real ones gives different real rows than an eager run of
    this batch. Every request gets its own blocks (from 1 up: never the null block), so no two
    tokens write one KV slot; the batch writes the KV cache of those blocks.
    """
    rng = np.random.default_rng([seed, key.num_tokens, key.num_reqs, int(key.uniform)])
    T, R = key.num_tokens, key.num_reqs
    if key.uniform:
        q_len = T // R
        q = np.full(max(1, R - 1), q_len, dtype=np.int64)
    else:
        num_tokens = T - max(1, T // 4) if T > 1 else 1
        num_reqs = min(max(1, R - max(1, R // 3)), num_tokens) if R > 1 else 1
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
    ids = rng.integers(0, vocab_size, int(q.sum()))
    return StepBatch(q, q + context, ids, blocks)


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


def _int_array(values, name: str, ndim: int) -> np.ndarray:
    """`values` as an integer numpy array the batch owns: a read-only copy (or conversion)."""
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
        array = array.astype(np.int64)  # np.asarray([]) is float64
    elif array.dtype.kind == "u" and array.itemsize == 8:
        # uint64 with int32 arithmetic promotes to float64 (staging would fail half-way):
        # refuse values above int32 here and keep the rest exactly as int64.
        if array.size:
            _check_int32(array, name)
        array = array.astype(np.int64)
    elif array.itemsize < 4:
        # int8/int16 are widened: the negative-id checks read negatives as unsigned, which
        # only exceeds the int32 range from 4 bytes up (int8 -1 would pass as block 255).
        array = array.astype(np.int32)
    array.flags.writeable = False
    return array


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


def _refuse_seq_lens(q: np.ndarray, s: np.ndarray) -> NoReturn:
    max_seq_len = int(amax(s))
    if max_seq_len > INT32_MAX:
        i = int(np.argmax(s))
        raise BatchError(f"seq_lens[{i}] is {max_seq_len}, above the int32 range of the buffers")
    i = int(np.argmax(s < q))
    raise BatchError(
        f"seq_lens[{i}] is {int(s[i])} but query_lens[{i}] is {int(q[i])}; "
        "seq_lens count every token of the request including this step's, "
        "so seq_lens >= query_lens"
    )


def _check_int32(array: np.ndarray, name: str) -> None:
    # uint32 is 4 bytes too, but holds values the int32 buffers cannot.
    top = int(array.max())
    if top > INT32_MAX:
        raise BatchError(f"{name} holds {top}, above the int32 range of the buffers")


def _short(array: np.ndarray) -> str:
    items = array.tolist()
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
