"""Stale data: with `checks.poison_padding` every byte outside the staged rows is garbage, and
long random streams of large and small, uniform and mixed steps still match eager exactly
on every real row (so nothing reads padding it should not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcap import StepBatch
from graphcap.staging import POISON
from graphcap.testing import FAULT_SIZES, make_config, make_manager, stress

SPEC = {"capture.uniform_query_len": 4, "capture.sizes": [4, 8]}


@pytest.fixture(scope="module", params=[1, 4], ids=["decode", "spec-decode-4"])
def poisoned(request):
    """A captured manager with poisoning on, and its uniform query length."""
    q = request.param
    manager = make_manager(make_config({"checks.poison_padding": True, **(SPEC if q > 1 else {})}))
    manager.capture()
    return manager, q


def test_poisoning_fills_every_row_outside_the_staged_key(poisoned):
    manager, _ = poisoned
    batch = StepBatch([1], [3], [5], [[1]])
    key = manager.dispatch(batch)
    manager.execute(batch)
    buffers = manager.buffers
    T, R = key.num_tokens, key.num_reqs
    for rows in (
        buffers.host["input_ids"][T:],
        buffers.host["positions"][T:],
        buffers.host["slot_mapping"][T:],
        buffers.host["query_start_loc"][R + 1 :],
        buffers.host["seq_lens"][R:],
    ):
        assert rows.size and (rows == POISON).all()
    assert (buffers.host["block_table"][R:] == POISON).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_graph_equals_eager_on_every_real_row_of_a_poisoned_random_stream(poisoned, seed):
    manager, q = poisoned
    manager.model.reset_kv_cache()
    result = stress(manager, 200, seed, spec_len=q)
    assert result.graph_steps and result.eager_steps, "the stream must mix replays and eager fallbacks"
    assert result.uniform_steps and result.mixed_steps, "and uniform and mixed keys"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 8))
def test_long_poisoned_streams(poisoned, seed):
    manager, q = poisoned
    manager.model.reset_kv_cache()
    result = stress(manager, 2500, seed, spec_len=q)
    assert result.graph_steps and result.eager_steps and result.uniform_steps and result.mixed_steps


def test_poison_turns_a_forgotten_pad_rule_into_a_loud_failure(monkeypatch):
    """Staging that forgets the positions tail: silent when the tail happens to hold valid
    stale values, an immediate error when poisoned (basic invariants do not read that tail)."""
    manager = make_manager(make_config(FAULT_SIZES, checks__invariants="basic"))
    manager.capture()
    buffers = manager.buffers
    fill = buffers.pad.fill

    def forgetful(T, R, n, r, width):
        stale = buffers.host["positions"][n:T].copy()
        fill(T, R, n, r, width)
        buffers.host["positions"][n:T] = stale  # the rule for positions is never applied

    monkeypatch.setattr(buffers.pad, "fill", forgetful)
    batch = StepBatch([2, 1], [6, 3], [1, 2, 3], [[1, 2], [3, 0]])  # 3 tokens padded to 4
    buffers.poison = False
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))  # silently stale
    buffers.poison = True
    with pytest.raises(IndexError, match="out of range"):
        manager.execute(batch)
    assert np.any(buffers.host["positions"][3:4] == POISON)
