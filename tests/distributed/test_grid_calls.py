"""A call one rank of a TP 2 x DP 2 grid makes alone fails at once on every rank of the grid.

One 4-rank gloo world (`_grid_worker.lone_calls`), the emulated backend. Every call agrees TP,
then DP; a rank whose TP agreement finds the ranks out of step still joins its DP agreement,
flagged, so the ranks of the other TP group learn it there; then every rank gathers every rank's
call and raises the same "ranks out of step" naming all four. A rank left waiting in its next
agreement would instead raise the timeout's message after `Parallel.timeout`.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _grid_worker as worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.lone_calls, 4, tmp_path_factory.mktemp("grid_calls"), timeout=300.0)


LONE_CALL = {
    "release": (2, "release() after step 1"),
    "capture": (3, "capture() starting after step 2"),
    "reset": (4, "reset() after step 3"),
    "dispatch": (5, "dispatch() of step 5"),
}
"""Rank 3's call -> (the step ranks 0-2 execute meanwhile, how the message names rank 3's call)."""


@pytest.mark.parametrize("call", list(LONE_CALL))
def test_a_call_rank_3_makes_alone_fails_on_every_rank_naming_every_call(ranks, call):
    step, lone = LONE_CALL[call]
    others = "".join(f"rank {r}: execute() of step {step}; " for r in range(3))
    for rank, result in enumerate(ranks):
        done = result[call]
        assert done["error"] == "DistributedTimeoutError", f"rank {rank}: {done}"
        assert "did not complete within" not in done["message"]  # no rank waited for the timeout
        assert (
            f"ranks out of step: the tensor-parallel x data-parallel ranks made different calls ({others}rank 3: {lone})"
            in done["message"]
        ), f"rank {rank}: {done['message']}"
        assert done["graphs"] == result["graphs"] == 8  # every rank kept its graphs
        after = done["next"]  # the same step again, on every rank: it replays the agreed key
        assert after["match"] == "ok", f"rank {rank}: {after}"
        assert after["key"] == GraphKey(4, 4, True), f"rank {rank}: {after}"
