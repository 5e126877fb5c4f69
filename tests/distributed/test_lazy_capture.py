"""Lazy capture across real processes (gloo, 2 ranks): `capture_pending` is a collective.

Every call captures the same keys on every rank, although each rank saw other traffic and asked
for another number of keys, so dispatch agreement never meets a key captured on one rank only;
every step's output equals eager on every rank. A key one rank times below `capture.min_speedup`
is dropped on every rank.
"""

from __future__ import annotations

import pytest

from tests.distributed import _lazy_worker
from tests.distributed._spawn import spawn_world

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(_lazy_worker.scenario, WORLD_SIZE, tmp_path_factory.mktemp("lazy_dp"))


def test_every_capture_pending_call_captures_the_same_keys_on_every_rank(world):
    first, *others = world
    for other in others:
        assert other["calls"] == first["calls"]


def test_ranks_stop_with_the_first_rank_that_stops_and_take_the_busiest_key_first(world):
    (one, after_one), (two, after_two), (rest, after_all) = world[0]["calls"]
    assert (one, two) == (1, 1)  # rank 0 asked for one key per call; rank 1 for three
    assert [(k.num_tokens, k.num_reqs, k.uniform) for k in after_one] == [(8, 8, True)]  # the 6 decodes of rank 1
    assert len(after_all) == world[0]["planned"] and rest == world[0]["planned"] - 2


def test_steps_replay_agreed_keys_and_equal_eager_on_every_rank(world):
    for result in world:
        assert result["mismatches"] == []
        assert result["eager"].get("pending", 0) > 0  # the first steps ran before any capture
    assert world[0]["keys"][-1] == world[1]["keys"][-1]
    assert world[0]["keys"][-1].num_tokens == 8  # after capture every step replays the agreed key of 8 tokens


def test_a_key_one_rank_times_below_min_speedup_is_dropped_on_every_rank(world):
    fast, slow = world[0]["min_speedup"], world[-1]["min_speedup"]
    assert fast["graphs"] == slow["graphs"] == 0
    assert fast["reasons"] == [
        "no_speedup: another data-parallel rank's replay was below capture.min_speedup 1 (the graph was released)"
    ]
    assert slow["reasons"] == [
        "no_speedup: replay 0.50x as fast as eager, below capture.min_speedup 1 (the graph was released)"
    ]
