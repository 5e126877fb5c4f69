"""Hostile batches are refused, naming the field and request, before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcap import StepBatch
from graphcap.models import dense_reference
from graphcap.testing import REFUSALS, assert_unchanged, hostile_batches, kv_cache, make_config, make_manager, snapshot

CONFIG = make_config()
HOSTILE = {h.name: h for h in hostile_batches(CONFIG)}


@pytest.fixture(scope="module")
def manager():
    manager = make_manager(CONFIG)
    manager.capture()
    return manager


def _refuse(manager, hostile, run):
    before = snapshot(manager)
    with pytest.raises(REFUSALS, match=hostile.match):
        run(StepBatch(*hostile.args))
    assert_unchanged(manager, before)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_batch_is_refused_before_any_buffer_or_kv_slot_is_written(manager, name):
    hostile = HOSTILE[name]
    _refuse(manager, hostile, manager.execute)
    _refuse(manager, hostile, manager.eager)


def test_after_every_refusal_the_next_valid_step_is_correct(manager):
    """Prefill a request, throw every hostile batch, then decode: rows match a dense reference."""
    manager.model.reset_kv_cache()
    tokens = [5, 17, 99, 3, 64, 1, 127, 42, 8]  # crosses two 4-token blocks
    table = [[7, 9, 11]]
    prefill = StepBatch([9], [9], tokens, table)
    first = manager.execute(prefill).clone()
    before = snapshot(manager)
    for hostile in HOSTILE.values():
        with pytest.raises(REFUSALS):
            manager.execute(StepBatch(*hostile.args))
    assert_unchanged(manager, before)
    next_token = int(first[-1].argmax())
    decode = StepBatch([1], [10], [next_token], table)
    assert manager.dispatch(decode) is not None, "the decode step must replay a graph"
    second = manager.execute(decode).clone()
    expected = dense_reference(manager.model, [[*tokens, next_token]])[0]
    torch.testing.assert_close(first, expected[:9])
    torch.testing.assert_close(second, expected[9:])
    # And the cache holds what the two valid steps wrote: rewriting it eagerly changes
    # nothing beyond rounding (a padded graph and an unpadded eager run round differently).
    cache = kv_cache(manager).clone()
    manager.eager(prefill)
    manager.eager(decode)
    torch.testing.assert_close(kv_cache(manager), cache)


def test_execute_refuses_an_argument_that_is_not_a_step_batch(manager):
    before = snapshot(manager)
    with pytest.raises(TypeError, match="expected a StepBatch"):
        manager.execute({"query_lens": [1], "seq_lens": [1]})
    assert_unchanged(manager, before)


@pytest.mark.parametrize("dtype", [np.int8, np.int16])
def test_negative_ids_in_narrow_int_arrays_are_refused(dtype):
    """-1 as int8 must not pass as block 255 (nor as token 65535 in int16)."""
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] is -1"):
        StepBatch([1], [5], None, np.array([[1, -1]], dtype))
    with pytest.raises(ValueError, match=r"input_ids\[0\] is -1"):
        StepBatch([1], [5], np.array([-1], dtype))


@pytest.mark.parametrize("dtype", [np.uint64, np.dtype(">i4"), np.int8, np.uint16])
def test_any_integer_dtype_stages_like_int64(manager, dtype):
    """uint64 once failed half-way through staging (float64 promotion) with a TypeError."""
    args = ([2, 1], [6, 3], [1, 2, 3], [[4, 5], [6, 0]])
    reference = manager.execute(StepBatch(*(np.array(a, np.int64) for a in args))).clone()
    host = manager.buffers.packed_host.copy()
    out = manager.execute(StepBatch(*(np.array(a, dtype) for a in args))).clone()
    assert np.array_equal(manager.buffers.packed_host, host)
    torch.testing.assert_close(out, reference)
