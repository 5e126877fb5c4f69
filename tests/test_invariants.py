"""`graphcap.checks.invariants`: every corrupted padded tail is caught and named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from graphcap.batch import StepBatch
from graphcap.checks.invariants import LEVELS, InvariantViolation, check_invariants
from graphcap.config import PadRules
from graphcap.keys import GraphKey
from tests.conftest import MAX_BLOCKS, NUM_BLOCKS, PAD_RULES, VOCAB, batches_and_keys, make_buffers

_SHARED = {name: make_buffers(rules) for name, rules in PAD_RULES.items()}
any_batch_and_key = batches_and_keys() | batches_and_keys(uniform_query_len=1) | batches_and_keys(uniform_query_len=2)
garbage = st.integers(-(2**31), 2**31 - 1) | st.integers(-3, 40)


def staged(case, rules="default"):
    """`case` staged into the shared buffers of `rules`, every padded row rewritten (an earlier
    example may have corrupted one; the manager does the same after a violation)."""
    batch, key = case
    buffers = _SHARED[rules]
    buffers.forget_padding()
    return buffers.stage(batch, key)


def violation(inputs, level="basic", dummy=False) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as info:
        check_invariants(inputs, level, dummy=dummy)
    return info.value


# -- the founding bug ----------------------------------------------------------------------


def test_query_start_loc_tail_left_at_zero_is_the_founding_bug():
    inputs = make_buffers().stage(StepBatch([3], [3]), GraphKey(8, 4, False))
    inputs.host.query_start_loc[:] = [0, 3, 0, 0, 0]  # the dummy run that forgot the tail
    error = violation(inputs)
    assert (error.field, error.index, error.expected, error.actual) == ("query_start_loc", 2, ">= 3", 0)
    assert "repeat >= 0" in str(error) and "query_start_loc[2] is 0" in str(error)
    assert "mixed(tokens=8, reqs=4)" in str(error)


def test_invariant_violation_is_a_runtime_error_with_where_and_values():
    error = InvariantViolation("seq_lens", 3, 0, 7, "why", GraphKey(8, 4, False))
    assert isinstance(error, RuntimeError)
    assert str(error) == "seq_lens[3] is 7, expected 0: why (key mixed(tokens=8, reqs=4))"


# -- every padded tail entry is checked ------------------------------------------------------

TAIL_FIELDS = {
    # field: level that checks its padded tail
    "query_start_loc": "basic",
    "seq_lens": "basic",
    "slot_mapping": "basic",
    "positions": "full",
    "input_ids": "full",
    "block_table": "full",
}


@given(case=any_batch_and_key, rules=st.sampled_from(sorted(PAD_RULES)), data=st.data())
@settings(max_examples=300, deadline=None)
def test_corrupting_any_single_padded_tail_entry_is_caught_and_named(case, rules, data):
    batch, key = case
    inputs = staged(case, rules)
    name = data.draw(st.sampled_from(sorted(TAIL_FIELDS)), "field")
    array = getattr(inputs.host, name)
    first = batch.num_reqs + 1 if name == "query_start_loc" else batch.num_tokens
    if name in ("seq_lens", "block_table"):
        first = batch.num_reqs
    assume(first < len(array))
    index = data.draw(st.integers(first, len(array) - 1), "index")
    column = data.draw(st.integers(0, MAX_BLOCKS - 1), "column") if name == "block_table" else None
    where = (index, column) if column is not None else index
    value = data.draw(garbage.filter(lambda v: v != array[where]), "value")
    array[where] = value
    dummy = batch.block_table is None  # no block table: the null block, as graphcap's own batches
    error = violation(inputs, TAIL_FIELDS[name], dummy)
    assert error.field == name
    assert error.index == (f"{index}, {column}" if column is not None else index)
    assert error.actual == value
    if TAIL_FIELDS[name] == "full":
        check_invariants(inputs, "basic", dummy=dummy)  # the O(tokens) tails are full-level only


def test_seq_lens_padded_row_not_zero_is_caught():
    inputs = make_buffers().stage(StepBatch([1, 1], [4, 5]), GraphKey(4, 4, True))
    inputs.host.seq_lens[3] = 9
    error = violation(inputs)
    assert (error.field, error.index, error.expected, error.actual) == ("seq_lens", 3, 0, 9)
    assert "padding.seq_len" in str(error)


def test_padded_slot_that_is_not_pad_slot_id_is_caught():
    inputs = make_buffers().stage(StepBatch([1, 1], [4, 5]), GraphKey(4, 4, True))
    inputs.host.slot_mapping[2] = 17  # would write a live request's KV cache
    error = violation(inputs)
    assert (error.field, error.index, error.expected, error.actual) == ("slot_mapping", 2, -1, 17)
    assert "PAD_SLOT_ID" in str(error)


def test_stale_positions_tail_is_caught_at_full_level():
    inputs = make_buffers().stage(StepBatch([2], [7]), GraphKey(4, 1, False))
    inputs.host.positions[3] = 77
    check_invariants(inputs, "basic", dummy=True)  # no block table: the null block, as graphcap's own batches
    error = violation(inputs, "full", dummy=True)
    assert (error.field, error.index, error.expected, error.actual) == ("positions", 3, 0, 77)


def test_padded_block_table_row_is_caught_at_full_level():
    inputs = make_buffers().stage(StepBatch([1], [1], block_table=[[5]]), GraphKey(2, 2, False))
    inputs.host.block_table[1, 2] = 7
    error = violation(inputs, "full")
    assert (error.field, error.index, error.expected, error.actual) == ("block_table", "1, 2", 0, 7)


# -- real rows (full level) ----------------------------------------------------------------


def real_inputs():
    batch = StepBatch([2, 1], [6, 9], input_ids=[5, 6, 7], block_table=[[11, 12, 0], [21, 22, 23]])
    return make_buffers().stage(batch, GraphKey(4, 2, False))


@pytest.mark.parametrize(
    ("field", "where", "value", "match"),
    [
        (
            "slot_mapping",
            1,
            NUM_BLOCKS * 4,
            rf"slot_mapping\[1\] is {NUM_BLOCKS * 4}, expected in \[0, {NUM_BLOCKS * 4}\)",
        ),
        ("slot_mapping", 0, -1, rf"slot_mapping\[0\] is -1, expected in \[0, {NUM_BLOCKS * 4}\)"),
        ("positions", 2, 7, r"positions\[2\] is 7, expected 8: positions are seq_len - query_len \+ offset"),
        ("positions", 0, 5, r"positions\[0\] is 5, expected 4"),
        ("input_ids", 1, VOCAB, rf"input_ids\[1\] is {VOCAB}, expected in \[0, {VOCAB}\)"),
        ("input_ids", 0, -5, r"input_ids\[0\] is -5"),
        ("block_table", (1, 0), NUM_BLOCKS, rf"block_table\[1, 0\] is {NUM_BLOCKS}, expected in \[0, {NUM_BLOCKS}\)"),
        ("block_table", (0, 5), -2, r"block_table\[0, 5\] is -2"),
    ],
)
def test_out_of_range_or_wrong_real_values_are_caught_at_full_level(field, where, value, match):
    inputs = real_inputs()
    check_invariants(inputs, "full")
    getattr(inputs.host, field)[where] = value
    check_invariants(inputs, "basic")  # O(tokens) rules are full-level only
    with pytest.raises(InvariantViolation, match=match) as info:
        check_invariants(inputs, "full")
    assert info.value.field == field


def test_real_seq_len_shorter_than_its_query_is_caught():
    inputs = real_inputs()
    inputs.host.seq_lens[0] = 1  # request 0 computes 2 tokens
    error = violation(inputs)
    assert (error.field, error.index, error.expected, error.actual) == ("seq_lens", 0, ">= 2", 1)


def test_negative_real_seq_len_is_caught():
    inputs = real_inputs()
    inputs.host.seq_lens[1] = -(2**31)  # garbage that wraps when subtracted in int32
    error = violation(inputs)
    assert (error.field, error.index, error.actual) == ("seq_lens", 1, -(2**31))


def test_query_start_loc_must_start_at_zero_and_end_real_rows_at_num_tokens():
    inputs = real_inputs()
    inputs.host.query_start_loc[0] = 1
    assert (violation(inputs).field, violation(inputs).index) == ("query_start_loc", 0)
    inputs = real_inputs()
    inputs.host.query_start_loc[1:] = [2, 2]  # the real requests own 2 tokens, not 3
    error = violation(inputs)
    assert (error.field, error.index, error.expected, error.actual) == ("query_start_loc", 2, 3, 2)


def test_decreasing_real_offsets_are_caught():
    inputs = real_inputs()
    inputs.host.query_start_loc[1] = 2**31 - 1  # would wrap to a positive length in int32
    error = violation(inputs)
    assert (error.field, error.index) == ("query_start_loc", 2)


def test_uniform_key_with_a_non_uniform_batch_is_caught():
    buffers = make_buffers()
    inputs = buffers.stage(StepBatch([1, 3], [1, 3], block_table=[[1], [2]]), GraphKey(4, 2, False))
    check_invariants(inputs)
    as_uniform = dataclasses.replace(inputs, key=GraphKey(4, 2, True))  # same rows, uniform kernels
    error = violation(as_uniform)
    assert (error.field, error.index, error.expected, error.actual) == ("query_start_loc", 1, 2, 1)
    assert "every real request of a uniform key has 2 tokens" in str(error)


def test_counts_that_do_not_fit_the_key_are_caught():
    inputs = real_inputs()
    error = violation(dataclasses.replace(inputs, num_tokens=5))
    assert (error.field, error.index, error.expected, error.actual) == ("num_tokens", None, "0..4", 5)
    error = violation(dataclasses.replace(inputs, num_reqs=3))
    assert (error.field, error.expected, error.actual) == ("num_reqs", "0..2", 3)


def test_pad_rules_with_one_token_per_padded_request_are_checked():
    buffers = make_buffers(PadRules(query_len=1, seq_len=1))
    inputs = buffers.stage(StepBatch([3], [3]), GraphKey(5, 4, False))
    check_invariants(inputs, "full", dummy=True)  # no block table: the null block, as dummy runs
    inputs.host.query_start_loc[2:] = 3  # the default rule's tail is wrong under this rule
    error = violation(inputs)
    assert (error.field, error.index, error.expected, error.actual) == ("query_start_loc", 2, 4, 3)


# -- levels ------------------------------------------------------------------------------


def test_level_off_checks_nothing():
    inputs = make_buffers().stage(StepBatch([3], [3]), GraphKey(8, 4, False))
    inputs.host.query_start_loc[:] = [0, 3, 0, 0, 0]
    inputs.host.slot_mapping[:] = 12345
    check_invariants(inputs, "off")


def test_unknown_level_raises_value_error():
    inputs = make_buffers().stage(StepBatch([1], [1]), GraphKey(1, 1, False))
    with pytest.raises(ValueError, match=r"level must be one of off, basic, full; got 'paranoid'"):
        check_invariants(inputs, "paranoid")
    assert LEVELS == ("off", "basic", "full")


@given(case=any_batch_and_key, rules=st.sampled_from(sorted(PAD_RULES)), data=st.data())
@settings(max_examples=200, deadline=None)
def test_basic_level_accepts_exactly_what_the_rule_by_rule_check_accepts(case, rules, data):
    # check_invariants("basic") takes a few-reduction fast path and names a violation with the
    # rule-by-rule checker; garbage anywhere in the staged rows must give the same verdict.
    from graphcap.checks.invariants import _check_basic
    from graphcap.checks.plans import basic_holds

    inputs = staged(case, rules)
    for _ in range(data.draw(st.integers(0, 2), "corruptions")):
        name = data.draw(st.sampled_from(["query_start_loc", "seq_lens", "slot_mapping"]), "field")
        array = getattr(inputs.host, name)
        array[data.draw(st.integers(0, len(array) - 1), "index")] = data.draw(garbage, "value")
    try:
        _check_basic(inputs)
        holds = True
    except InvariantViolation:
        holds = False
    assert basic_holds(inputs) == holds
    np.testing.assert_equal(holds, _passes(inputs))


FULL_FIELDS = ["query_start_loc", "seq_lens", "slot_mapping", "positions", "input_ids", "block_table"]


@given(
    case=any_batch_and_key,
    rules=st.sampled_from(sorted(PAD_RULES)),
    kv_writes=st.booleans(),
    dummy=st.booleans(),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_full_level_proof_accepts_only_what_the_rule_by_rule_checks_accept(case, rules, kv_writes, dummy, data):
    # check_invariants("full") takes the few-call proof (`full_holds`) first; garbage anywhere in
    # the staged rows must never pass the proof unless the rule-by-rule checks pass it too, and a
    # valid step takes the proof (else the fast path would be a slow path in disguise).
    from graphcap.checks.invariants import _check_full, _check_kv_writes, _lengths
    from graphcap.checks.plans import basic_holds, full_holds

    inputs = staged(case, rules)
    valid = kv_writes or not inputs.num_tokens  # a staged real step writes its slots
    if not kv_writes:
        inputs.host.slot_mapping[: inputs.num_tokens] = inputs.limits.pad.slot  # as capture's reading probe
        valid = True
    for _ in range(data.draw(st.integers(0, 2), "corruptions")):
        valid = False
        array = getattr(inputs.host, data.draw(st.sampled_from(FULL_FIELDS), "field")).reshape(-1)
        array[data.draw(st.integers(0, len(array) - 1), "index")] = data.draw(garbage, "value")
    if not basic_holds(inputs):
        return
    try:
        lens = _lengths(inputs.host.query_start_loc)
        _check_full(inputs, lens, kv_writes)
        if kv_writes:
            _check_kv_writes(inputs, lens, dummy or case[0].block_table is None)
        holds = True
    except InvariantViolation:
        holds = False
    proven = full_holds(inputs, kv_writes, dummy or case[0].block_table is None)
    assert holds or not proven
    if valid:
        assert proven


def _passes(inputs) -> bool:
    try:
        check_invariants(inputs)
    except InvariantViolation:
        return False
    return True


# -- where real tokens write the KV cache (full, real steps) --------------------------------


def kv_inputs(**overrides):
    """Two requests with their own blocks: [11, 12] and [21, 22, 23] (block size 4)."""
    batch = StepBatch([2, 1], [6, 9], input_ids=[5, 6, 7], block_table=[[11, 12, 0], [21, 22, 23]])
    inputs = make_buffers().stage(batch, GraphKey(4, 2, False))
    check_invariants(inputs, "full")
    return inputs


def test_slot_outside_its_own_requests_blocks_is_caught():
    inputs = kv_inputs()
    inputs.host.slot_mapping[2] = 21 * 4 + 0  # request 1's token (position 8: block 23) into its block 21
    error = violation(inputs, "full")
    assert (error.field, error.index, error.expected, error.actual) == ("slot_mapping", 2, 23 * 4 + 0, 84)
    assert "own request's block" in str(error)


def test_slot_in_another_requests_block_is_caught():
    inputs = kv_inputs()
    inputs.host.slot_mapping[2] = 12 * 4 + 3  # into request 0's block: overwrites its cache
    error = violation(inputs, "full")
    assert (error.field, error.index) == ("slot_mapping", 2)


def test_real_token_in_the_null_block_is_caught_for_real_steps_only():
    # Request 0 writes position 2 (column 0: block 7), request 1 position 4 (column 1: block 9);
    # request 0 never uses column 1, so its zero there is the pad, not a block it holds.
    batch = StepBatch([1, 1], [3, 5], [1, 2], block_table=[[7, 0], [8, 9]])
    inputs = make_buffers().stage(batch, GraphKey(2, 2, False))
    check_invariants(inputs, "full")
    bad = StepBatch([1, 1], [3, 5], [1, 2], block_table=[[7, 0], [9, 0]])  # request 1 writes column 1 = 0
    inputs = make_buffers().stage(bad, GraphKey(2, 2, False))
    with pytest.raises(InvariantViolation, match=r"slot_mapping\[1\] is 0, expected a slot outside block 0"):
        check_invariants(inputs, "full")  # the basic rule sees it first
    with pytest.raises(
        InvariantViolation, match=r"block_table\[1, 1\] is 0, .*request 1 writes this step's keys into the null"
    ):
        _check_kv_writes_of(inputs)  # the full rule names the block
    check_invariants(inputs, "full", dummy=True)  # capture's own batches share the null block by design
    check_invariants(inputs, "basic", dummy=True)


def test_a_real_token_in_the_null_block_is_refused_at_basic_naming_the_token_and_slot():
    # Request 1's token writes slot 4 of block 1; request 0's token slot 2 of block 0, the null block, which
    # capture and padded rows write: a later capture() would overwrite that request's keys and values.
    batch = StepBatch([1, 1], [3, 1], [1, 2], block_table=[[0], [1]])
    inputs = make_buffers().stage(batch, GraphKey(4, 2, False))
    error = violation(inputs, "basic")
    assert (error.field, error.index, error.actual) == ("slot_mapping", 0, 2)
    assert "block 0, graphcap's null block" in str(error) and "never hand out block 0" in str(error)
    with pytest.raises(InvariantViolation, match=r"slot_mapping\[0\] is 2, expected a slot outside block 0 \(>= 4\)"):
        check_invariants(inputs)  # the default level
    check_invariants(inputs, "basic", dummy=True)  # graphcap's own batches share the null block by design
    check_invariants(inputs, "basic", kv_writes=False)  # a verification batch whose tokens write nothing
    fine = make_buffers().stage(StepBatch([1, 1], [3, 1], [1, 2], block_table=[[2], [1]]), GraphKey(4, 2, False))
    check_invariants(fine, "basic")


def _check_kv_writes_of(inputs):
    from graphcap.checks.invariants import _check_kv_writes, _lengths

    _check_kv_writes(inputs, _lengths(inputs.host.query_start_loc), False)


def test_a_context_block_that_is_the_null_block_is_caught_for_real_steps_only():
    # Request 1 (5 tokens, block size 4) reads its first 4 keys from column 0, which names the null
    # block: it would attend to whatever padded rows and dummy runs last wrote there.
    batch = StepBatch([1, 1], [3, 5], [1, 2], block_table=[[7, 0], [0, 9]])
    inputs = make_buffers().stage(batch, GraphKey(2, 2, False))
    with pytest.raises(InvariantViolation, match=r"block_table\[1, 0\] is 0, .*request 1 reads the null block 0"):
        check_invariants(inputs, "full")
    check_invariants(inputs, "full", dummy=True)  # capture's own batches share the null block by design
    check_invariants(inputs, "basic")


def test_two_tokens_writing_one_slot_are_caught():
    batch = StepBatch([1, 1], [3, 3], [1, 2], block_table=[[7], [7]])  # both write block 7, offset 2
    inputs = make_buffers().stage(batch, GraphKey(2, 2, False))
    with pytest.raises(InvariantViolation, match=r"slot_mapping\[1\] is 30, expected a slot no other token writes"):
        check_invariants(inputs, "full")
    shared_prefix = StepBatch([1, 1], [5, 5], [1, 2], block_table=[[7, 8], [7, 9]])  # context block shared
    check_invariants(make_buffers().stage(shared_prefix, GraphKey(2, 2, False)), "full")  # prefix caching is fine


@pytest.mark.parametrize(("field", "index", "value"), [("seq_lens", 1, 25), ("positions", 2, 24)])
def test_lengths_and_positions_past_max_model_len_are_caught(field, index, value):
    inputs = kv_inputs()
    getattr(inputs.host, field)[index] = value  # max_model_len is 24; as a buggy prepare() would write
    error = violation(inputs, "full")
    assert error.field in (field, "positions")
    with pytest.raises(InvariantViolation, match=r"max_model_len|positions"):
        check_invariants(inputs, "full")


@given(case=any_batch_and_key)
@settings(max_examples=80, deadline=None)
def test_every_valid_real_step_passes_the_kv_write_rules(case):
    batch, key = case
    inputs = staged(case)
    check_invariants(inputs, "full", dummy=batch.block_table is None)
