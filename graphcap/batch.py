"""`StepBatch` (one scheduler step, host side), `GraphKey`, and dummy batches for capture.

A `StepBatch` is what a scheduler hands the model runner: per-request query lengths (the
tokens computed this step) and total sequence lengths, optionally the token ids and the
block table. It validates itself on construction with vectorized numpy, so an engine that
already keeps numpy arrays pays no per-request Python loop.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["GraphKey", "StepBatch", "dummy_batch"]

_INT32_MAX = np.iinfo(np.int32).max


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

    Arrays are converted (not copied when already int32/int64 numpy); the caller must not
    mutate them afterwards.
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
    )

    def __init__(self, query_lens, seq_lens, input_ids=None, block_table=None) -> None:
        q = _int_array(query_lens, "query_lens", 1)
        s = _int_array(seq_lens, "seq_lens", 1)
        num_reqs = len(q)
        if len(s) != num_reqs:
            raise ValueError(
                f"seq_lens has {len(s)} entries but query_lens has {num_reqs}; give one entry per request in both"
            )
        if num_reqs:
            q_min, q_max = int(q.min()), int(q.max())
            if q_min < 1:
                i = int(np.argmax(q < 1))
                raise ValueError(
                    f"query_lens[{i}] is {int(q[i])}; every scheduled request computes at "
                    "least one token: drop requests with nothing to compute from the step"
                )
            max_seq_len = int(s.max())
            if max_seq_len > _INT32_MAX:
                i = int(np.argmax(s))
                raise ValueError(f"seq_lens[{i}] is {max_seq_len}, above the int32 range of the buffers")
            short = s < q
            if short.any():
                i = int(np.argmax(short))
                raise ValueError(
                    f"seq_lens[{i}] is {int(s[i])} but query_lens[{i}] is {int(q[i])}; "
                    "seq_lens count every token of the request including this step's, "
                    "so seq_lens >= query_lens"
                )
            num_tokens = int(q.sum())
        else:
            q_min = q_max = max_seq_len = 0
            num_tokens = 0
        if input_ids is not None:
            input_ids = _int_array(input_ids, "input_ids", 1, check_range=True)
            if len(input_ids) != num_tokens:
                raise ValueError(
                    f"input_ids has {len(input_ids)} entries but query_lens sum to {num_tokens}; "
                    "give one token id per computed token, in request order"
                )
            if num_tokens and int(input_ids.min()) < 0:
                t = int(np.argmax(input_ids < 0))
                raise ValueError(f"input_ids[{t}] is {int(input_ids[t])}; token ids are >= 0")
        if block_table is not None:
            block_table = _int_array(block_table, "block_table", 2, check_range=True)
            if block_table.shape[0] != num_reqs:
                raise ValueError(
                    f"block_table has {block_table.shape[0]} rows but the batch has {num_reqs} "
                    "requests; give one row per request"
                )
            if block_table.size and int(block_table.min()) < 0:
                i, j = np.argwhere(block_table < 0)[0]
                raise ValueError(f"block_table[{i}, {j}] is {int(block_table[i, j])}; block ids are >= 0")
        self.query_lens = q
        self.seq_lens = s
        self.input_ids = input_ids
        self.block_table = block_table
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        self.min_query_len = q_min
        self.max_query_len = q_max
        self.max_seq_len = max_seq_len

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
            raise ValueError(f"uniform {key} must have num_tokens divisible by num_reqs")
        q = np.full(R, T // R, dtype=np.int32)
    else:
        limit = max_model_len or T
        num_real = max(1, R // 2, -(-T // limit))
        if num_real > R or num_real > T:
            raise ValueError(f"{key} cannot hold {T} tokens in requests of at most {limit}")
        q = np.full(num_real, T // num_real, dtype=np.int32)
        q[: T % num_real] += 1
    return StepBatch(q, q.copy())


def _int_array(values, name: str, ndim: int, *, check_range: bool = False) -> np.ndarray:
    array = values if isinstance(values, np.ndarray) else np.asarray(values)
    if array.ndim != ndim:
        if not (array.size == 0 and ndim == 2):
            raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(array.shape)}")
        array = array.reshape(0, 0)
    if array.dtype.kind not in "iu":
        if array.size != 0:
            raise ValueError(f"{name} must hold integers; got dtype {array.dtype}")
        array = array.astype(np.int64)  # np.asarray([]) is float64
    if check_range and array.dtype.itemsize > 4 and array.size and int(array.max()) > _INT32_MAX:
        raise ValueError(f"{name} holds {int(array.max())}, above the int32 range of the buffers")
    return array


def _short(array: np.ndarray) -> str:
    items = array.tolist()
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
