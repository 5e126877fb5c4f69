"""A seeded randomized two-rank run (`_machine_worker.machine`), one rank misbehaving at random points (slow).

Every event's outcome must be the one the rules give (docs/guide/distributed.md), no rank ever
waits for `Parallel.timeout`, and the probe step after every event replays on both ranks with the
single-process reference output.
"""

from __future__ import annotations

import pytest

from tests.distributed import _machine_worker as worker
from tests.distributed._spawn import spawn_world

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_random_run_with_one_misbehaving_rank_holds_every_rule(tmp_path, seed):
    (tmp_path / "seed.txt").write_text(f"{seed} 24")
    ranks = spawn_world(worker.machine, 2, tmp_path, timeout=600.0)
    for index, pair in enumerate(zip(*(result["events"] for result in ranks)), 1):
        kind, lone = pair[0]["kind"], pair[0]["lone"]
        for rank, done in enumerate(pair):
            where = f"seed {seed}, event {index} ({kind}, lone rank {lone}), rank {rank}: {done}"
            assert "did not complete within" not in done.get("message", ""), where
            if kind == "step" or (kind in ("refused", "refused_after") and rank != lone):
                assert done.get("match") == "ok", where
            elif kind == "refused":
                assert done["error"] == "BatchError", where
            elif kind == "refused_after":
                assert done["error"] == "InvariantViolation", where
            elif kind.startswith("lone_"):
                assert done["error"] == "DistributedTimeoutError" and "ranks out of step" in done["message"], where
                assert done["graphs"] == ranks[rank]["graphs"], where  # nothing released
            else:
                assert done.get("value") == ranks[rank]["graphs"], where
            assert done["probe"]["match"] == "ok", where
        assert pair[0]["probe"]["key"] == pair[1]["probe"]["key"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"] > 0
