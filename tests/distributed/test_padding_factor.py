"""`capture.max_padding_factor` across real processes (gloo, 2 ranks): ranks agree on it.

A step that one rank's own check sends eagerly (its graph would pad past the factor) runs eagerly on
every rank (that rank counts `over_padding`, the others `peer`); when every rank is within the factor,
every rank replays the same graph. Outputs equal eager on every rank.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _padding_worker
from tests.distributed._spawn import spawn_world

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(_padding_worker.scenario, WORLD_SIZE, tmp_path_factory.mktemp("padding_dp"))


def test_one_rank_over_the_factor_makes_every_rank_run_eagerly(world):
    reasons = [result["asymmetric"]["reasons"] for result in world]
    assert reasons == [["over_padding"]] + [["peer"]] * (WORLD_SIZE - 1)


def test_every_rank_within_the_factor_replays_the_same_graph(world):
    for result in world:
        step = result["within"]
        assert step["replayed"] and step["key"] == GraphKey(16, 8, False), f"rank {result['rank']}: {step}"


def test_outputs_equal_eager_on_every_rank(world):
    for result in world:
        assert all(result[name]["match"] for name in _padding_worker.STEPS), f"rank {result['rank']}"
