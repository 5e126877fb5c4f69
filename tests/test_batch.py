"""`graphcap.batch`: StepBatch validation, GraphKey, dummy batches."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.batch import StepBatch, dummy_batch
from graphcap.errors import BatchError
from graphcap.keys import GraphKey
from graphcap.probe import probe_fills
from graphcap.staging import PersistentBuffers
from tests.conftest import BLOCK_SIZE, NUM_BLOCKS, make_buffers

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("dtype", [None, np.int32, np.int64, np.uint16])
def test_step_batch_accepts_lists_and_integer_arrays(dtype):
    def arr(values):
        return values if dtype is None else np.array(values, dtype=dtype)

    batch = StepBatch(arr([1, 3, 2]), arr([5, 3, 9]), arr([7, 8, 9, 10, 11, 12]), arr([[1, 2], [3, 0], [4, 5]]))
    assert (batch.num_reqs, batch.num_tokens) == (3, 6)
    assert (batch.min_query_len, batch.max_query_len, batch.max_seq_len) == (1, 3, 9)
    assert (batch.max_token_id, batch.max_block_id) == (12, 5)
    assert batch.query_lens.tolist() == [1, 3, 2] and batch.seq_lens.tolist() == [5, 3, 9]
    assert batch.block_table.shape == (3, 2)


def test_what_stage_checked_is_what_it_staged_even_when_the_caller_reuses_its_arrays():
    """Native int arrays are referenced, so stage checks the values it stages in the same pass."""
    q, s = np.array([1, 1], np.int32), np.array([4, 9], np.int64)
    ids, table = np.array([3, 4], np.int32), np.array([[1, 2, 0], [2, 3, 4]], np.int32)
    batch = StepBatch(q, s, ids, table)
    buffers = make_buffers()
    q[0] = 0  # query_lens decided num_tokens and uniformity at construction: the batch keeps its own
    assert batch.query_lens.tolist() == [1, 1] and batch.num_tokens == 2
    with pytest.raises(ValueError, match="read-only"):
        batch.query_lens[0] = 7
    for array, index, bad, match in (
        (s, 0, -5, r"seq_lens\[0\] is -5"),
        (ids, 1, -1, r"input_ids\[1\] is -1"),
        (table, (1, 0), -1, r"block_table\[1, 0\] is -1"),
        (table, (1, 2), NUM_BLOCKS, rf"block_table\[1, 2\] is {NUM_BLOCKS}, outside the KV cache"),
    ):
        good = array[index]
        array[index] = bad  # the scheduler reuses its arrays before the step is staged
        before = buffers.packed_host.copy()
        with pytest.raises(ValueError, match=match):
            buffers.stage(batch, GraphKey(4, 2, False))
        assert buffers.packed_host.tobytes() == before.tobytes()  # refused before any write
        array[index] = good
    s[1], ids[1] = 10, 7  # valid changes are staged as they are now, and checked
    inputs = buffers.stage(batch, GraphKey(4, 2, False))
    assert inputs.seq_lens[:2].tolist() == [4, 10] and inputs.input_ids[:2].tolist() == [3, 7]
    assert inputs.slot_mapping[:2].tolist() == [1 * BLOCK_SIZE + 3, 4 * BLOCK_SIZE + 1]


def test_converted_inputs_are_owned_read_only_copies_checked_at_construction():
    s = [4, 9]
    batch = StepBatch([1, 1], s, np.array([3, 4], np.int16), [[1], [2]])
    s[0] = -5
    assert batch.seq_lens.tolist() == [4, 9] and batch.input_ids.dtype == np.int32
    for array in (batch.seq_lens, batch.input_ids, batch.block_table):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 7


def test_step_batch_without_ids_or_blocks():
    batch = StepBatch([1], [1])
    assert batch.input_ids is None and batch.block_table is None
    assert (batch.max_token_id, batch.max_block_id) == (-1, -1)


@pytest.mark.parametrize("empty", [[], np.array([], np.int32), np.zeros(0, np.int64)])
def test_empty_batch_has_no_requests_and_no_tokens(empty):
    batch = StepBatch(empty, empty, input_ids=[], block_table=[])
    assert (batch.num_reqs, batch.num_tokens, batch.max_query_len, batch.max_seq_len) == (0, 0, 0, 0)
    assert batch.block_table.shape == (0, 0)
    assert batch.is_uniform(1) and batch.is_uniform(4)


def test_is_uniform_means_every_request_has_exactly_that_many_tokens():
    assert StepBatch([1, 1, 1], [3, 4, 5]).is_uniform(1)
    assert not StepBatch([1, 1, 1], [3, 4, 5]).is_uniform(2)
    assert StepBatch([4, 4], [4, 9]).is_uniform(4)
    assert not StepBatch([4, 2], [4, 9]).is_uniform(4)
    assert not StepBatch([1, 2], [4, 9]).is_uniform(1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query_lens": [1, 1], "seq_lens": [2]}, r"seq_lens has 1 entries but query_lens has 2"),
        ({"query_lens": [1, 0], "seq_lens": [2, 2]}, r"query_lens\[1\] is 0; every scheduled request computes"),
        ({"query_lens": [-2, 1], "seq_lens": [2, 2]}, r"query_lens\[0\] is -2"),
        ({"query_lens": [1, 4, 1], "seq_lens": [1, 3, 1]}, r"seq_lens\[1\] is 3 but query_lens\[1\] is 4"),
        ({"query_lens": [1, 1, 1], "seq_lens": [1, 5, 0]}, r"seq_lens\[2\] is 0 but query_lens\[2\] is 1"),
        ({"query_lens": [1, 1], "seq_lens": [-1, 5]}, r"seq_lens\[0\] is -1 but query_lens\[0\] is 1"),
        ({"query_lens": [1], "seq_lens": [2**31]}, r"seq_lens\[0\] is 2147483648, above the int32 range"),
        (
            {"query_lens": [2, 1], "seq_lens": [2, 1], "input_ids": [1, 2]},
            r"input_ids has 2 entries but query_lens sum to 3",
        ),
        ({"query_lens": [1.0], "seq_lens": [1]}, r"query_lens must hold integers; got dtype float64"),
        ({"query_lens": [1], "seq_lens": np.array([1.5])}, r"seq_lens must hold integers; got dtype float64"),
        ({"query_lens": [True], "seq_lens": [1]}, r"query_lens must hold integers; got dtype bool"),
        ({"query_lens": [[1, 1]], "seq_lens": [1, 1]}, r"query_lens must be 1-D; got shape \(1, 2\)"),
        ({"query_lens": 1, "seq_lens": 1}, r"query_lens must be 1-D; got shape \(\)"),
        ({"query_lens": [1, 1], "seq_lens": [1, 1], "input_ids": [3, -1]}, r"input_ids\[1\] is -1; token ids are >= 0"),
        ({"query_lens": [1], "seq_lens": [1], "input_ids": [2**31]}, r"input_ids holds 2147483648, above the int32"),
        ({"query_lens": [1], "seq_lens": [1], "input_ids": [0.5]}, r"input_ids must hold integers"),
        ({"query_lens": [1], "seq_lens": [1], "block_table": [1, 2]}, r"block_table must be 2-D; got shape \(2,\)"),
        (
            {"query_lens": [1, 1], "seq_lens": [1, 1], "block_table": [[1, 2]]},
            r"block_table has 1 rows but the batch has 2 requests",
        ),
        (
            {"query_lens": [1, 1], "seq_lens": [1, 1], "block_table": [[1, 2], [3, -4]]},
            r"block_table\[1, 1\] is -4; block ids are >= 0",
        ),
        ({"query_lens": [1], "seq_lens": [1], "block_table": [[2**31]]}, r"block_table holds 2147483648, above the int32"),
    ],
)  # fmt: skip
def test_step_batch_refuses_invalid_steps(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepBatch(**kwargs)


@pytest.mark.parametrize("field", ["input_ids", "block_table"])
def test_uint32_values_above_int32_are_refused(field):
    # Regression: 4-byte unsigned arrays skipped the int32 range check and wrapped negative in the buffers.
    value = np.array([3_000_000_000], np.uint32)
    kwargs = {"input_ids": value} if field == "input_ids" else {"block_table": value.reshape(1, 1)}
    with pytest.raises(ValueError, match=rf"{field} holds 3000000000, above the int32 range"):
        StepBatch([1], [1], **kwargs)


def test_int64_extremes_are_refused_not_wrapped():
    buffers = make_buffers()
    for ids, match in (
        (np.array([np.iinfo(np.int64).max]), r"input_ids holds 9223372036854775807"),
        (np.array([np.iinfo(np.int64).min]), r"input_ids\[0\] is -9223372036854775808"),
        (np.array([2**32 + 3]), r"input_ids holds 4294967299, above the int32"),  # would wrap to token 3
    ):
        with pytest.raises(ValueError, match=match):
            buffers.stage(StepBatch([1], [1], input_ids=ids), GraphKey(1, 1, False))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] is 4294967297, above the int32"):
        buffers.stage(StepBatch([1], np.array([2**32 + 1])), GraphKey(1, 1, False))  # would wrap to 1


@given(
    query_lens=st.lists(st.integers(-3, 6), max_size=10),
    context=st.lists(st.integers(-4, 20), max_size=10),
)
@settings(max_examples=150, deadline=None)
def test_step_batch_accepts_exactly_the_valid_steps(query_lens, context):
    context = (context + [0] * len(query_lens))[: len(query_lens)]
    seq_lens = [q + c for q, c in zip(query_lens, context)]
    valid = all(q >= 1 for q in query_lens) and all(s >= q for s, q in zip(seq_lens, query_lens))
    buffers = PersistentBuffers(10, 60, 8, block_size=4, max_model_len=32)  # holds any step drawn here
    key = GraphKey(60, 10, False)
    for form in (list, np.int32, np.int64):

        def make(values, form=form):
            return values if form is list else np.array(values, form)

        if valid:
            batch = StepBatch(make(query_lens), make(seq_lens))
            assert batch.num_tokens == sum(query_lens) and batch.num_reqs == len(query_lens)
            assert batch.max_seq_len == max(seq_lens, default=0)
            buffers.stage(batch, key)
        else:
            # query_lens are checked at construction; a seq_len the batch references (a native
            # int array) when it is staged, one it converted (a list) at construction.
            with pytest.raises(ValueError, match=r"(query_lens|seq_lens)\[\d+\] is -?\d+"):
                buffers.stage(StepBatch(make(query_lens), make(seq_lens)), key)


def test_repr_shortens_long_arrays():
    text = repr(StepBatch([1] * 20, [2] * 20))
    assert text.startswith("StepBatch(num_reqs=20, num_tokens=20, query_lens=[1, 1, 1, 1, 1, 1, 1, 1, ...]")


@pytest.mark.parametrize(("tokens", "reqs"), [(1, 1), (8, 8), (64, 16), (12, 3)])
def test_dummy_batch_for_a_uniform_key_fills_every_request(tokens, reqs):
    batch = dummy_batch(GraphKey(tokens, reqs, True))
    assert (batch.num_tokens, batch.num_reqs) == (tokens, reqs)
    assert batch.is_uniform(tokens // reqs)
    assert batch.seq_lens.tolist() == batch.query_lens.tolist()


@pytest.mark.parametrize(("tokens", "reqs"), [(2, 2), (8, 8), (64, 32), (256, 32), (5, 4), (7, 3)])
def test_dummy_batch_for_a_mixed_key_leaves_padded_requests_and_no_padded_tokens(tokens, reqs):
    batch = dummy_batch(GraphKey(tokens, reqs, False))
    assert batch.num_tokens == tokens  # every token real
    assert 1 <= batch.num_reqs < reqs  # the founding bug's padded requests exist during capture
    assert batch.max_query_len - batch.min_query_len <= 1


def test_dummy_batch_for_a_single_request_mixed_key():
    batch = dummy_batch(GraphKey(16, 1, False))
    assert (batch.num_reqs, batch.num_tokens) == (1, 16)


def test_dummy_batch_respects_max_model_len():
    batch = dummy_batch(GraphKey(64, 16, False), max_model_len=5)
    assert batch.num_tokens == 64 and batch.max_seq_len <= 5 and batch.num_reqs == 13


def test_dummy_batch_refuses_keys_it_cannot_fill():
    with pytest.raises(ValueError, match=r"uniform\(tokens=10, reqs=4\) must have num_tokens divisible by num_reqs"):
        dummy_batch(GraphKey(10, 4, True))
    with pytest.raises(ValueError, match=r"mixed\(tokens=64, reqs=4\) cannot hold 64 tokens in requests of at most 8"):
        dummy_batch(GraphKey(64, 4, False), max_model_len=8)
    with pytest.raises(BatchError, match=r"dummy_batch\(piecewise\(tokens=8\)\): a piecewise key has no request count"):
        dummy_batch(GraphKey(8, None, False))
    with pytest.raises(BatchError, match=r"probe_fills\(piecewise\(tokens=8\)\): a piecewise key has no request count"):
        probe_fills(GraphKey(8, None, False), max_model_len=16)


def test_non_native_byte_order_arrays_are_checked_like_native_ones():
    with pytest.raises(ValueError, match=r"input_ids\[1\] is -1; token ids are >= 0"):
        StepBatch([1, 1], [1, 1], input_ids=np.array([3, -1], ">i4"))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] is 0 but query_lens\[1\] is 1"):
        StepBatch(np.array([1, 1], ">i8"), np.array([2, 0], ">i8"))
    batch = StepBatch(np.array([1, 1], ">i8"), np.array([2, 3], ">i8"), block_table=np.array([[4], [5]], ">i4"))
    assert (batch.max_query_len, batch.max_seq_len, batch.max_block_id) == (1, 3, 5)


@given(lengths=st.lists(st.integers(0, 4), min_size=2, max_size=5).filter(lambda n: len(set(n)) > 1))
def test_a_ragged_block_table_is_refused_naming_its_rows_and_the_padding_fix(lengths):
    from graphcap import BatchError

    rows = [list(range(1, n + 1)) for n in lengths]
    short = next(i for i, n in enumerate(lengths) if n != lengths[0])
    expected = (
        f"block_table rows have different lengths (row 0: {lengths[0]} blocks, row {short}: {lengths[short]}); it "
        f"is one rectangular array: pad every row to the longest ({max(lengths)}) with 0, the null block"
    )
    n = len(lengths)
    with pytest.raises(BatchError, match=rf"^{re.escape(expected)}.*\(manager\.block_table\)$"):
        StepBatch([1] * n, [1] * n, block_table=rows)
    with pytest.raises(BatchError, match=r"^kv_groups\['swa'\] rows have .*\(manager\.kv_group_tables\['swa'\]\)$"):
        StepBatch([1] * n, [1] * n, kv_groups={"swa": rows})
    padded = [row + [0] * (max(lengths) - len(row)) for row in rows]  # the fix the message names
    assert StepBatch([1] * n, [1] * n, block_table=padded).block_table.shape == (n, max(lengths))
