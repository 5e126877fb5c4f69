"""Why a step is refused: the slow checks that find the first problem and name it.

The hot path (`graphcap.staging.passes`) proves a step valid with a few vectorized
comparisons; only when one fails does it call `refuse_step`, which walks the rules one by one
in a fixed order and raises `BatchError` naming the field, the request, the value and the fix.
A property test holds the two to the same verdict.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from graphcap._fastnp import amax
from graphcap.batch import StepBatch, check_block_ids, check_seq_lens, check_token_ids
from graphcap.block_table import BlockTable
from graphcap.errors import BatchError
from graphcap.inputs import StagingLimits
from graphcap.keys import GraphKey

__all__ = ["check_fits", "refuse_internal", "refuse_step"]


def check_fits(batch: StepBatch, key: GraphKey, max_num_tokens: int, max_num_reqs: int) -> None:
    """The counts: the batch fits the buffers and the key; a uniform key gets a uniform batch."""
    T, R = key.num_tokens, batch.num_reqs if key.num_reqs is None else key.num_reqs
    if batch.num_tokens > max_num_tokens:
        raise BatchError(
            f"batch has {batch.num_tokens} tokens, above batching.max_num_tokens {max_num_tokens}; "
            "the scheduler must split the step"
        )
    if batch.num_reqs > max_num_reqs:
        raise BatchError(
            f"batch has {batch.num_reqs} requests, above batching.max_num_seqs {max_num_reqs}; "
            "the scheduler must split the step"
        )
    if max_num_tokens < T or max_num_reqs < R or T < 0 or R < 0:
        raise BatchError(f"{key} exceeds the buffers (max_num_tokens {max_num_tokens}, max_num_reqs {max_num_reqs})")
    if batch.num_tokens > T or batch.num_reqs > R:
        what, have, hold = ("tokens", batch.num_tokens, T) if batch.num_tokens > T else ("requests", batch.num_reqs, R)
        raise BatchError(f"batch has {have} {what} but {key} holds {hold}")
    if key.uniform and R and not batch.is_uniform(T // R):
        raise BatchError(
            f"{key} needs every request to have {T // R} tokens; the batch has query_lens "
            f"from {batch.min_query_len} to {batch.max_query_len}: stage it with a mixed key"
        )


def refuse_step(
    batch: StepBatch, key: GraphKey, limits: StagingLimits, counts: tuple[int, int], table: BlockTable | None
) -> None:
    """Raise `BatchError` for the first rule `batch` breaks when staged into `key`; return if none.

    `counts` is `(max_num_tokens, max_num_reqs)` of the buffers; `table` the buffers'
    `BlockTable` (the rows a persistent step names).
    """
    check_fits(batch, key, *counts)
    q, s, ids, bt = batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table
    check_seq_lens(q, s)
    lim = limits
    r = batch.num_reqs
    if r and lim.max_model_len is not None and amax(s) > lim.max_model_len:
        i = int(np.argmax(s > lim.max_model_len))
        raise BatchError(
            f"seq_lens[{i}] is {int(s[i])}, above max_model_len {lim.max_model_len} "
            "(kv_cache.max_model_len); finish or truncate the request"
        )
    if ids is not None:
        check_token_ids(ids)
        if lim.vocab_size is not None and len(ids) and amax(ids) >= lim.vocab_size:
            t = int(np.argmax(ids >= lim.vocab_size))
            req = int(np.searchsorted(np.cumsum(q), t, side="right"))
            raise BatchError(
                f"input_ids[{t}] (request {req}) is {int(ids[t])}, outside the vocabulary "
                f"[0, {lim.vocab_size}) (model.vocab_size)"
            )
    if bt is table and table is not None:
        table.check_step(s, r, r if key.num_reqs is None else key.num_reqs)
    elif isinstance(bt, np.ndarray):  # a table the step brings
        check_block_ids(bt)
        if r:
            _check_fresh_table(bt, s, lim)


def _check_fresh_table(bt: np.ndarray, s: np.ndarray, lim: StagingLimits) -> None:
    width = bt.shape[1]
    if width > lim.max_blocks_per_req:
        raise BatchError(
            f"block_table has {width} columns; the buffers hold {lim.max_blocks_per_req} "
            f"per request (kv_cache.max_model_len / block_size)"
        )
    if lim.num_blocks is not None and bt.size and amax(bt.ravel()) >= lim.num_blocks:
        i, j = np.argwhere(bt >= lim.num_blocks)[0]
        raise BatchError(
            f"block_table[{i}, {j}] is {int(bt[i, j])}, outside the KV cache [0, {lim.num_blocks}) "
            "(kv_cache.num_blocks)"
        )
    if amax(s) > width * lim.block_size:
        need = -(-s // lim.block_size)
        i = int(np.argmax(need > width))
        raise BatchError(
            f"request {i} has seq_len {int(s[i])}, which needs {int(need[i])} blocks of {lim.block_size}, "
            f"but block_table has {width} columns"
        )


def refuse_internal(what: str) -> NoReturn:
    """A fast check refused a step the rule-by-rule checks accept: a graphcap bug, never a user error."""
    raise RuntimeError(
        f"graphcap: the fast staging check refused a step the full checks accept ({what}); please report"
    )
