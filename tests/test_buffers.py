"""`graphcap.staging` (`PersistentBuffers`): one staging path, pad rules, refusals that write nothing, stable addresses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.batch import StepBatch, dummy_batch
from graphcap.checks.invariants import check_invariants
from graphcap.config import PadRules, load_config
from graphcap.inputs import ForwardInputs
from graphcap.keys import GraphKey
from graphcap.staging import POISON, PersistentBuffers
from tests.conftest import (
    BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    PAD_RULES,
    VOCAB,
    batches_and_keys,
    make_buffers,
)

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")
# One buffer set per pad rule, reused across examples: leftovers of earlier examples must never show.
_SHARED = {name: make_buffers(rules) for name, rules in PAD_RULES.items()}
any_batch_and_key = batches_and_keys() | batches_and_keys(uniform_query_len=1) | batches_and_keys(uniform_query_len=3)
any_rules = st.sampled_from(sorted(PAD_RULES))


def reference(batch: StepBatch, key: GraphKey, pad: PadRules) -> dict[str, list]:
    """What every field must hold, built the obvious way: per request, per token, in Python."""
    T, R = key.num_tokens, key.num_reqs
    qsl, positions, slots, ids, rows = [0], [], [], [], []
    table = None if batch.block_table is None else batch.block_table.tolist()
    for i, (query_len, seq_len) in enumerate(zip(batch.query_lens.tolist(), batch.seq_lens.tolist())):
        qsl.append(qsl[-1] + query_len)
        for position in range(seq_len - query_len, seq_len):
            block = 0 if table is None else table[i][position // BLOCK_SIZE]
            positions.append(position)
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE)
        row = [0] * MAX_BLOCKS if table is None else table[i] + [pad.block_id] * (MAX_BLOCKS - len(table[i]))
        rows.append(row)
    n, r = len(positions), len(rows)
    ids = [0] * n if batch.input_ids is None else batch.input_ids.tolist()
    seq = batch.seq_lens.tolist()
    for k in range(1, R - r + 1):
        qsl.append(min(n + pad.query_len * k, T))
        seq.append(pad.seq_len)
        rows.append([pad.block_id] * MAX_BLOCKS)
    positions += [pad.position] * (T - n)
    slots += [pad.slot] * (T - n)
    ids += [pad.token_id] * (T - n)
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": qsl,
        "seq_lens": seq,
        "block_table": rows,
    }


def real_rows(name: str, batch: StepBatch) -> slice:
    if name in ("input_ids", "positions", "slot_mapping"):
        return slice(0, batch.num_tokens)
    return slice(0, batch.num_reqs + (name == "query_start_loc"))


def tail_rows(name: str, batch: StepBatch) -> slice:
    return slice(real_rows(name, batch).stop, None)


# -- staging is right --------------------------------------------------------------------


@given(case=any_batch_and_key, rules=any_rules)
@settings(max_examples=200, deadline=None)
def test_any_valid_batch_staged_into_any_key_it_fits_passes_full_invariants(case, rules):
    batch, key = case
    inputs = _SHARED[rules].stage(batch, key)
    check_invariants(inputs, "full", dummy=batch.block_table is None)  # no block table: the null block
    assert (inputs.num_tokens, inputs.num_reqs, inputs.key) == (batch.num_tokens, batch.num_reqs, key)
    assert inputs.input_ids.shape == (key.num_tokens,) and inputs.query_start_loc.shape == (key.num_reqs + 1,)
    assert inputs.block_table.shape == (key.num_reqs, MAX_BLOCKS)


@given(case=any_batch_and_key, rules=any_rules)
@settings(max_examples=150, deadline=None)
def test_staged_real_rows_equal_a_per_request_python_reference(case, rules):
    batch, key = case
    inputs = _SHARED[rules].stage(batch, key)
    expected = reference(batch, key, PAD_RULES[rules])
    for name in FIELDS:
        rows = real_rows(name, batch)
        assert getattr(inputs, name)[rows].tolist() == expected[name][rows], name


@given(case=any_batch_and_key, rules=any_rules)
@settings(max_examples=150, deadline=None)
def test_padded_tails_follow_the_pad_rules(case, rules):
    batch, key = case
    inputs = _SHARED[rules].stage(batch, key)
    expected = reference(batch, key, PAD_RULES[rules])
    for name in FIELDS:
        rows = tail_rows(name, batch)
        assert getattr(inputs, name)[rows].tolist() == expected[name][rows], name


def test_padded_query_start_loc_tail_equals_last_offset(buffers):
    inputs = buffers.stage(StepBatch([3], [3]), GraphKey(8, 4, False))
    assert inputs.query_start_loc.tolist() == [0, 3, 3, 3, 3]  # not the founding bug's [0, 3, 0, 0, 0]
    assert inputs.seq_lens.tolist() == [3, 0, 0, 0]
    assert inputs.slot_mapping[3:].tolist() == [-1] * 5


def test_sglang_pad_rules_give_padded_requests_one_token_while_tokens_remain():
    buffers = make_buffers(PadRules(query_len=1, seq_len=1))
    inputs = buffers.stage(StepBatch([3], [3]), GraphKey(5, 4, False))
    assert inputs.query_start_loc.tolist() == [0, 3, 4, 5, 5]
    assert inputs.seq_lens.tolist() == [3, 1, 1, 1]
    check_invariants(inputs, "full", dummy=True)  # no block table: the null block


def test_slots_without_a_block_table_use_the_null_block(buffers):
    inputs = buffers.stage(StepBatch([2, 1], [6, 3]), GraphKey(4, 2, False))
    assert inputs.positions.tolist() == [4, 5, 2, 0]
    assert inputs.slot_mapping.tolist() == [0, 1, 2, -1]  # positions % block_size in block 0, then the pad slot
    assert inputs.block_table.tolist() == [[0] * MAX_BLOCKS] * 2


def test_slots_come_from_each_requests_own_block_table_row(buffers):
    # request 0: 2 new tokens at positions 4, 5 (block index 1); request 1: one token at position 8 (block 2)
    batch = StepBatch([2, 1], [6, 9], input_ids=[5, 6, 7], block_table=[[11, 12, 0], [21, 22, 23]])
    inputs = buffers.stage(batch, GraphKey(4, 2, False))
    assert inputs.slot_mapping.tolist() == [12 * 4 + 0, 12 * 4 + 1, 23 * 4 + 0, -1]
    assert inputs.block_table[:, :4].tolist() == [[11, 12, 0, 0], [21, 22, 23, 0]]
    assert inputs.input_ids.tolist() == [5, 6, 7, 0]


@given(
    first=batches_and_keys(),
    second=batches_and_keys(),
    rules=any_rules,
)
@settings(max_examples=100, deadline=None)
def test_a_large_batch_then_a_small_one_leaves_nothing_stale_in_the_keys_rows(first, second, rules):
    big, _ = first
    small, key = second
    key = GraphKey(max(key.num_tokens, big.num_tokens), max(key.num_reqs, big.num_reqs), False)
    buffers = make_buffers(PAD_RULES[rules])
    buffers.stage(big, key)
    staged = buffers.stage(small, key)
    fresh = make_buffers(PAD_RULES[rules]).stage(small, key)
    for name in FIELDS:
        assert torch.equal(getattr(staged, name), getattr(fresh, name)), name


def test_dummy_batches_stage_and_pass_full_invariants():
    config = load_config()
    buffers = PersistentBuffers.from_config(config)
    for key in (GraphKey(64, 32, False), GraphKey(32, 32, True), GraphKey(1, 1, False), GraphKey(16, 16, True)):
        inputs = buffers.stage(dummy_batch(key, max_model_len=config.kv_cache.max_model_len), key)
        check_invariants(inputs, "full", dummy=True)


# -- refusals write nothing --------------------------------------------------------------

REFUSALS = [
    # (what, batch factory, key, message)
    ("key_above_buffers", lambda: StepBatch([1], [1]), GraphKey(MAX_TOKENS + 1, 1, False), r"exceeds the buffers"),
    ("key_reqs_above_buffers", lambda: StepBatch([1], [1]), GraphKey(8, MAX_REQS + 1, False), r"exceeds the buffers"),
    ("tokens_above_key", lambda: StepBatch([3, 3], [3, 3]), GraphKey(4, 2, False), r"batch has 6 tokens but mixed\(tokens=4, reqs=2\) holds 4"),
    ("reqs_above_key", lambda: StepBatch([1, 1, 1], [1, 1, 1]), GraphKey(4, 2, False), r"batch has 3 requests but .* holds 2"),
    ("tokens_above_buffers", lambda: StepBatch([MAX_TOKENS + 1], [MAX_TOKENS + 1]), GraphKey(8, 2, False), rf"batch has {MAX_TOKENS + 1} tokens"),
    ("reqs_above_buffers", lambda: StepBatch([1] * (MAX_REQS + 1), [1] * (MAX_REQS + 1)), GraphKey(16, 4, False), rf"batch has {MAX_REQS + 1} requests"),
    ("uniform_mismatch", lambda: StepBatch([1, 2], [1, 2]), GraphKey(4, 4, True), r"needs every request to have 1 tokens; the batch has query_lens from 1 to 2"),
    ("seq_len_above_max_model_len", lambda: StepBatch([1], [MAX_BLOCKS * BLOCK_SIZE + 1]), GraphKey(1, 1, False), r"seq_lens\[0\] is 25, above max_model_len 24"),
    ("token_id_above_vocab", lambda: StepBatch([2, 2], [2, 2], input_ids=[1, 2, VOCAB, 3]), GraphKey(4, 2, False), rf"input_ids\[2\] \(request 1\) is {VOCAB}, outside the vocabulary"),
    ("block_table_too_wide", lambda: StepBatch([1], [1], block_table=[[1] * (MAX_BLOCKS + 1)]), GraphKey(1, 1, False), rf"block_table has {MAX_BLOCKS + 1} columns; the buffers hold {MAX_BLOCKS}"),
    ("block_id_above_cache", lambda: StepBatch([1, 1], [1, 1], block_table=[[1, 2], [3, NUM_BLOCKS]]), GraphKey(2, 2, False), rf"block_table\[1, 1\] is {NUM_BLOCKS}, outside the KV cache"),
    ("block_table_too_narrow", lambda: StepBatch([1, 1], [4, 9], block_table=[[1, 2], [3, 4]]), GraphKey(2, 2, False), r"request 1 has seq_len 9, which needs 3 blocks of 4, but block_table has 2 columns"),
    ("step_batch_negative_block", lambda: StepBatch([1], [1], block_table=[[-1]]), GraphKey(1, 1, False), r"block_table\[0, 0\] is -1"),
    ("step_batch_short_seq", lambda: StepBatch([2], [1]), GraphKey(2, 1, False), r"seq_lens\[0\] is 1 but query_lens\[0\] is 2"),
    ("step_batch_ids_length", lambda: StepBatch([2], [2], input_ids=[1]), GraphKey(2, 1, False), r"input_ids has 1 entries"),
    ("step_batch_float", lambda: StepBatch([1.5], [2]), GraphKey(2, 1, False), r"must hold integers"),
]  # fmt: skip


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize(("what", "make_batch", "key", "match"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_batch_leaves_the_packed_host_buffer_byte_identical(what, make_batch, key, match, poison):
    buffers = make_buffers(PAD_RULES["odd"], poison=poison)
    buffers.stage(
        StepBatch([3, 2], [9, 5], input_ids=[1, 2, 3, 4, 5], block_table=[[1, 2, 3], [4, 5, 6]]), GraphKey(8, 4, False)
    )
    before = buffers.packed_host.copy()
    with pytest.raises(ValueError, match=match):
        buffers.stage(make_batch(), key)
    assert buffers.packed_host.tobytes() == before.tobytes()


# -- addresses: allocated once, never replaced -------------------------------------------


@given(steps=st.lists(any_batch_and_key, min_size=2, max_size=6))
@settings(max_examples=40, deadline=None)
def test_data_ptr_of_every_forward_input_is_stable_and_never_reallocated(steps):
    buffers = make_buffers()
    packed = buffers.storage()["packed"]
    packed_ptr, packed_size = packed.data_ptr(), packed.numel()
    seen: dict[tuple[int, int], dict[str, int]] = {}
    for batch, key in steps + steps:
        inputs = buffers.stage(batch, key)
        ptrs = {name: t.data_ptr() for name, t in inputs.tensors().items()}
        assert seen.setdefault((key.num_tokens, key.num_reqs), ptrs) == ptrs
        for tensor in inputs.tensors().values():  # every view lies inside the one packed allocation
            assert packed_ptr <= tensor.data_ptr() < packed_ptr + packed_size * 4
            assert tensor.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert buffers.storage()["packed"] is packed and packed.data_ptr() == packed_ptr


def test_views_of_two_keys_share_their_first_rows(buffers):
    small = buffers.stage(StepBatch([1], [1]), GraphKey(2, 1, False))
    large = buffers.stage(StepBatch([1], [1]), GraphKey(8, 4, False))
    for name in FIELDS:
        assert getattr(small, name).data_ptr() == getattr(large, name).data_ptr(), name


def test_cpu_tensors_are_zero_copy_views_of_the_host_arrays(buffers):
    inputs = buffers.stage(StepBatch([2, 1], [5, 3], input_ids=[4, 5, 6]), GraphKey(4, 2, False))
    assert buffers.device == torch.device("cpu")
    for name in FIELDS:
        tensor, host = getattr(inputs, name), getattr(inputs.host, name)
        assert tensor.dtype == torch.int32 and tensor.device.type == "cpu"
        assert np.shares_memory(tensor.numpy(), host), name
        assert tensor.data_ptr() == host.ctypes.data, name
    inputs.host.input_ids[0] = 42
    assert int(inputs.input_ids[0]) == 42


def test_forward_inputs_names_its_static_tensors(buffers):
    inputs = buffers.stage(StepBatch([1], [1]), GraphKey(1, 1, False))
    assert isinstance(inputs, ForwardInputs)
    assert list(inputs.tensors()) == [
        "query_start_loc",
        "seq_lens",
        "input_ids",
        "positions",
        "slot_mapping",
        "block_table",
        "num_tokens_device",
        "num_reqs_device",
    ]
    fields_bytes = 4 * (3 * MAX_TOKENS + 2 * MAX_REQS + 1 + MAX_REQS * MAX_BLOCKS + 2)
    assert fields_bytes <= buffers.nbytes < fields_bytes + 64 * 7  # each field starts 64-byte aligned


# -- poison ------------------------------------------------------------------------------


@given(case=any_batch_and_key)
@settings(max_examples=60, deadline=None)
def test_poison_fills_unstaged_rows_with_the_sentinel_and_staged_rows_pass(case):
    batch, key = case
    buffers = make_buffers(poison=True)
    buffers.stage(StepBatch([1] * MAX_REQS, [2] * MAX_REQS), GraphKey(MAX_TOKENS, MAX_REQS, False))
    inputs = buffers.stage(batch, key)
    check_invariants(inputs, "full", dummy=batch.block_table is None)
    T, R = key.num_tokens, key.num_reqs
    staged = 3 * T + (R + 1) + R + R * MAX_BLOCKS + 2  # the rows, and the step's two counts
    packed = buffers.storage()["packed"].numpy().view(np.int32)
    assert np.count_nonzero(packed != POISON) == staged
    for name in FIELDS:
        assert not np.any(getattr(inputs.host, name) == POISON), name
    assert (int(inputs.num_tokens_device), int(inputs.num_reqs_device)) == (batch.num_tokens, batch.num_reqs)


# -- construction ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_num_reqs", "max_num_tokens", "max_blocks_per_req", "block_size"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_buffers_refuse_non_positive_or_non_integer_sizes(name, value):
    kwargs = {"max_num_reqs": 2, "max_num_tokens": 4, "max_blocks_per_req": 2, "block_size": 4}
    kwargs[name] = value
    with pytest.raises(ValueError, match=rf"PersistentBuffers: {name} must be an integer >= 1; got {value!r}"):
        PersistentBuffers(**kwargs)


def test_buffers_from_config_take_the_maxima_and_pad_rules():
    config = load_config(overrides={"padding.query_len": 1, "padding.seq_len": 1, "checks.poison_padding": True})
    buffers = PersistentBuffers.from_config(config)
    assert (buffers.max_num_reqs, buffers.max_num_tokens, buffers.max_blocks_per_req) == (32, 256, 32)
    assert buffers.limits.pad == config.padding and buffers.poison
    assert buffers.limits.num_slots == 256 * 16


def test_non_native_byte_order_batches_stage_the_same_values(buffers):
    native = StepBatch([1, 2], [5, 9], input_ids=[7, 8, 9], block_table=[[1, 2, 3], [4, 5, 6]])
    swapped = StepBatch(
        np.array([1, 2], ">i8"),
        np.array([5, 9], ">i8"),
        input_ids=np.array([7, 8, 9], ">i4"),
        block_table=np.array([[1, 2, 3], [4, 5, 6]], ">i4"),
    )
    key = GraphKey(4, 4, False)
    expected = {name: t.clone() for name, t in buffers.stage(native, key).tensors().items()}
    staged = buffers.stage(swapped, key)
    check_invariants(staged, "full")
    for name, tensor in staged.tensors().items():
        assert torch.equal(tensor, expected[name]), name
