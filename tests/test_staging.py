"""`graphcap.staging`: the fast checks agree with the rule-by-rule refusals; padded rows stay right."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import BufferSpec, StepBatch
from graphcap.checks.invariants import check_invariants
from graphcap.errors import BatchError, InvariantViolation
from graphcap.keys import GraphKey
from graphcap.manager import CaptureManager
from graphcap.staging import PersistentBuffers
from graphcap.staging.refusals import refuse_step
from tests.conftest import (
    BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_MODEL_LEN,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    VOCAB,
    make_buffers,
)

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")
# Values at and around every bound the checks compare against.
EDGES = st.sampled_from([-(2**31), -(2**40), -1, 0, 1, 2, BLOCK_SIZE, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, VOCAB - 1,
                         VOCAB, NUM_BLOCKS - 1, NUM_BLOCKS, 2**31 - 1, 2**31, 2**33])  # fmt: skip


@st.composite
def risky_steps(draw):
    """A step that is valid or breaks one or a few value rules; `(batch, key, table rows or None)`."""
    r = draw(st.integers(1, MAX_REQS))
    decode = draw(st.booleans())
    q = [1] * r if decode else [draw(st.integers(1, 3)) for _ in range(r)]
    s = [v + draw(st.integers(0, MAX_MODEL_LEN - v)) for v in q]
    ids = [draw(st.integers(0, VOCAB - 1)) for _ in range(sum(q))]
    table = [[draw(st.integers(1, NUM_BLOCKS - 1)) for _ in range(MAX_BLOCKS)] for _ in range(r)]
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from(["seq_lens", "input_ids", "block_table"]))
        value = draw(EDGES)
        if where == "seq_lens":
            s[draw(st.integers(0, r - 1))] = value
        elif where == "input_ids":
            ids[draw(st.integers(0, len(ids) - 1))] = value
        else:
            table[draw(st.integers(0, r - 1))][draw(st.integers(0, MAX_BLOCKS - 1))] = value
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    source = draw(st.sampled_from(["fresh", "persistent", "null"]))
    key = GraphKey(MAX_TOKENS, MAX_REQS, False) if not decode or draw(st.booleans()) else GraphKey(r, r, True)
    fits = all(0 <= v <= 2**31 - 1 for v in np.array(s).ravel())
    s_array = np.array(s, np.int64).astype(dtype) if fits or dtype is np.int64 else np.array(s, np.int64)
    ids_array = np.array(ids, np.int64)
    if dtype is np.int32 and np.all((ids_array >= -(2**31)) & (ids_array < 2**31)):
        ids_array = ids_array.astype(np.int32)
    table_array = np.array(table, np.int64)
    rows = None
    if source == "persistent":  # valid rows (writes are checked by the table), often too short
        rows = [np.clip(row[: draw(st.integers(0, MAX_BLOCKS))], 1, NUM_BLOCKS - 1) for row in table_array]
        block_table = None
    elif source == "fresh":
        block_table = table_array.astype(np.int32) if np.all(np.abs(table_array) < 2**31) else table_array
    else:
        block_table = None
    q_array = np.array(q, np.int32)
    return (q_array, s_array, ids_array, block_table), key, rows


@given(step=risky_steps())
@settings(max_examples=400, deadline=None)
def test_staging_refuses_exactly_what_the_rule_by_rule_checks_refuse_and_names_it_alike(step):
    (q, s, ids, block_table), key, rows = step
    buffers = make_buffers()
    if rows is not None:
        for row, blocks in enumerate(rows):
            buffers.block_table.set_row(row, blocks)
        block_table = buffers.block_table
    try:
        batch = StepBatch(q, s, ids, block_table)
    except BatchError:
        return  # arrays StepBatch converts are checked at construction
    before = buffers.packed_host.copy()
    try:
        buffers.stage(batch, key)
    except BatchError as refused:
        assert buffers.packed_host.tobytes() == before.tobytes()
        with pytest.raises(BatchError) as named:
            refuse_step(batch, key, buffers.limits, (MAX_TOKENS, MAX_REQS), buffers.block_table)
        assert str(named.value) == str(refused)
        return
    refuse_step(batch, key, buffers.limits, (MAX_TOKENS, MAX_REQS), buffers.block_table)  # accepts it too


def test_the_same_key_and_counts_get_the_same_forward_inputs_object():
    buffers = make_buffers()
    first = buffers.stage(StepBatch(np.ones(3, np.int32), np.array([2, 3, 4], np.int32)), GraphKey(4, 4, True))
    second = buffers.stage(StepBatch(np.ones(3, np.int32), np.array([5, 6, 7], np.int32)), GraphKey(4, 4, True))
    assert first is second and second.seq_lens[:3].tolist() == [5, 6, 7]
    other = buffers.stage(StepBatch(np.ones(2, np.int32), np.array([5, 6], np.int32)), GraphKey(4, 4, True))
    assert other is not first and other.num_reqs == 2


def test_int64_arrays_stage_like_int32_ones():
    args = ([1, 1, 1], [5, 9, 17], [4, 5, 6], [[1, 2, 3, 0, 0, 0], [4, 5, 6, 0, 0, 0], [7, 8, 9, 10, 11, 12]])
    narrow = make_buffers().stage(StepBatch(*(np.array(a, np.int32) for a in args)), GraphKey(4, 4, True))
    wide = make_buffers().stage(StepBatch(*(np.array(a, np.int64) for a in args)), GraphKey(4, 4, True))
    for name in FIELDS:
        assert torch.equal(getattr(narrow, name), getattr(wide, name)), name


@pytest.mark.parametrize("level", ["basic", "full"])
def test_after_a_violation_the_next_staging_rewrites_every_padded_row(level):
    """Padded rows are rewritten only where a step dirtied them, so a row something else wrote
    stays until a check finds it; from then on nothing staged earlier is trusted."""
    buffers = make_buffers()
    batch = StepBatch(np.ones(2, np.int32), np.array([3, 4], np.int32))
    inputs = buffers.stage(batch, GraphKey(8, 8, False))
    field, value = ("slot_mapping", 5) if level == "basic" else ("positions", 77)
    getattr(inputs.host, field)[6] = value  # a padded row written by someone else
    with pytest.raises(InvariantViolation, match=field):
        check_invariants(inputs, level, dummy=True)  # no block table: the null block, as graphcap's own batches
    buffers.forget_padding()  # what CaptureManager does when a check fails
    check_invariants(buffers.stage(batch, GraphKey(8, 8, False)), "full", dummy=True)  # no block table: the null block


@pytest.mark.parametrize("level", ["basic", "full"])
def test_a_manager_step_after_a_violation_rewrites_every_padded_row(level):
    """Through the manager: prepare() writes a padded row once; that step is refused, the next one is clean."""
    from graphcap.models import build_model
    from graphcap.testing import make_config

    corrupt = [True]
    field = "slot_mapping" if level == "basic" else "positions"

    class Model(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            return self.inner(inputs)

        def prepare(self, inputs, phase):
            if phase == "replay" and corrupt and inputs.num_tokens < len(inputs.host.input_ids):
                corrupt.clear()
                getattr(inputs.host, field)[-1] = 5  # a padded row written by someone else, once

    config = make_config({"checks.invariants": level})
    manager = CaptureManager(Model(build_model(config)), config, progress=False)
    manager.capture()
    batch = StepBatch(np.ones(3, np.int32), np.array([3, 4, 5], np.int32))
    with pytest.raises(InvariantViolation, match=field):
        manager.execute(batch)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


def test_a_smaller_step_rewrites_only_the_rows_the_larger_one_dirtied():
    buffers = make_buffers()
    buffers.stage(StepBatch([3, 2], [5, 6], [1, 2, 3, 4, 5]), GraphKey(8, 4, False))
    before = buffers.packed_host.copy()
    inputs = buffers.stage(StepBatch([1], [2], [9]), GraphKey(8, 4, False))
    check_invariants(inputs, "full", dummy=True)  # no block table: the null block
    changed = buffers.packed_host.view(np.int32) != before.view(np.int32)
    untouched = buffers.host["positions"][5:].ctypes.data - buffers.packed_host.ctypes.data
    assert not changed[untouched // 4 : untouched // 4 + MAX_TOKENS - 5].any()  # past the old step: clean


# -- engine buffers ----------------------------------------------------------------------------


def _with_extras(poison=False):
    specs = [
        BufferSpec("temperature", "reqs", dtype="float32", pad=1.0),
        BufferSpec("mrope", "tokens", shape=(3,), row_dim=1, pad=-1),
        BufferSpec("flags", "none", shape=(2,), dtype="bool", pad=False),
    ]
    buffers = PersistentBuffers(
        MAX_REQS, MAX_TOKENS, MAX_BLOCKS, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
        vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, poison=poison, extras=specs,
    )  # fmt: skip
    return buffers


@pytest.mark.parametrize("poison", [False, True])
def test_engine_buffers_are_staged_and_padded_with_decode_and_mixed_steps(poison):
    buffers = _with_extras(poison)
    for q in ([1, 1], [2, 1]):
        n = sum(q)
        extras = {"temperature": [0.5, 0.7], "mrope": np.arange(3 * n).reshape(3, n), "flags": [True, False]}
        inputs = buffers.stage(StepBatch(np.array(q, np.int32), [4, 5], extras=extras), GraphKey(4, 4, False))
        check_invariants(inputs, "full", dummy=True)  # no block table: the null block
        assert inputs.extras["temperature"].tolist() == [0.5, 0.699999988079071, 1.0, 1.0]
        assert inputs.extras["mrope"][:, :n].tolist() == np.arange(3 * n).reshape(3, n).tolist()
        assert (inputs.extras["mrope"][:, n:] == -1).all() and inputs.extras["flags"].tolist() == [True, False]
    inputs = buffers.stage(StepBatch(np.ones(1, np.int32), [3]), GraphKey(2, 2, False))  # no extras given: pads
    assert inputs.extras["temperature"].tolist() == [1.0, 1.0] and inputs.extras["flags"].tolist() == [False, False]
    assert (inputs.extras["mrope"] == -1).all()


def test_engine_buffer_rows_of_the_wrong_shape_are_refused_before_any_write():
    buffers = _with_extras()
    before = buffers.packed_host.copy()
    with pytest.raises(BatchError, match=r"extras\['temperature'\] has shape \(3,\); expected \(2,\)"):
        buffers.stage(StepBatch(np.ones(2, np.int32), [4, 5], extras={"temperature": [1, 2, 3]}), GraphKey(2, 2, True))
    with pytest.raises(BatchError, match=r"extras\['nope'\]: no such buffer"):
        buffers.stage(StepBatch(np.ones(2, np.int32), [4, 5], extras={"nope": [1, 2]}), GraphKey(2, 2, True))
    assert buffers.packed_host.tobytes() == before.tobytes()
