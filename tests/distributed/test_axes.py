"""Key axes with data-parallel peers (gloo, 2 ranks): the agreement includes every axis.

Each step the ranks state different slot counts; both replay the same combination (the largest value
on any rank, padded) or both run eagerly, and every output equals the rank's own eager run.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _axes_worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(_axes_worker.scenario, 2, tmp_path_factory.mktemp("axes_dp"))


def test_both_ranks_replay_the_largest_slot_count_padded(world):
    first, second = (result["steps"][0] for result in world)
    assert first["key"] == second["key"] == GraphKey(4, 4, True, (("lora", 4),))
    assert first["matches_eager"] and second["matches_eager"]


def test_a_value_above_the_largest_on_one_rank_runs_the_step_eagerly_on_both(world):
    first, second = (result["steps"][1] for result in world)
    assert first["key"] == GraphKey(2, 2, False, (("lora", 0),))  # each rank's own counts and values
    assert second["key"] == GraphKey(5, 5, False, (("lora", 5),))
    assert first["matches_eager"] and second["matches_eager"]
    assert world[0]["eager"]["peer"] == 1 and world[1]["eager"]["above_max_axis.lora"] == 1


def test_an_idle_rank_joins_the_agreed_combination(world):
    idle, busy = (result["steps"][2] for result in world)
    assert idle["key"] == busy["key"] == GraphKey(4, 4, False, (("lora", 2),))
    assert busy["matches_eager"]


def test_a_rank_naming_an_unplanned_axis_runs_the_step_idle_then_raises(world):
    refused, other = (result["steps"][3] for result in world)
    assert refused["error"] == "BatchError" and "'lroa', which capture.axes does not plan" in refused["message"]
    assert refused["key"] == other["key"] == GraphKey(4, 4, True, (("lora", 1),))  # the peer's step went on
    assert other["matches_eager"]


def test_pad_eager_pads_an_eager_step_to_the_largest_axis_values_too(world):
    for result in world:
        assert result["pad_eager"]["key"] == GraphKey(3, 3, False, (("lora", 3),))  # rank 1's 3 tokens, 3 adapters
        assert result["pad_eager"]["matches_eager"]
