"""A rank whose capture forward fails in the first warmup of a key: every rank fails, or skips the key, at once.

Two gloo tensor-parallel ranks, the emulated backend; the model's all-reduce runs on a gloo group of
its own, graphcap's agreements on graphcap's own group. Rank 1 raises before the all-reduce of the
first warmup of each size-4 key: no forward of that shape has completed anywhere, so it issues the
collectives its peer publishes for the key (the other warmups and the recording) with zero tensors;
its peer completes the key, and the key's agreement tells both. The canary turns the ledger off:
rank 0 stays in its all-reduce until the model group's (short) timeout ends it.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _failure_worker as worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.first_warmup, 2, tmp_path_factory.mktemp("capture_failures"), timeout=240.0)


def uniform(size: int) -> GraphKey:
    return GraphKey(size, size, True)


def test_graphcaps_agreements_run_on_a_group_of_their_own_never_the_models(ranks):
    for rank, result in enumerate(ranks):
        assert result["own_group"] and result["own_group_ranks"] == [0, 1], f"rank {rank}"


def test_a_first_warmup_failure_with_on_error_raise_raises_on_every_rank_naming_rank_key_and_phase(ranks):
    for rank, result in enumerate(ranks):
        done = result["raise"]
        assert done["first_failed_forward"] == "warmup 4", done
        assert done["error"] == "CaptureError", f"rank {rank}: {done}"
        assert "capturing uniform(tokens=4, reqs=4) failed" in done["message"], done["message"]
        expected = (
            "injected failure on rank 1 before the all-reduce (in its warmup on this rank)"
            if rank == 1
            else "rank 1 failed to capture it in its warmup; parallel ranks keep the same keys"
        )
        assert expected in done["message"], done["message"]
    # Rank 1 issued rank 0's collectives of the key: the all-reduce of each warmup and of the recording.
    assert [r["raise"]["completed"] for r in ranks] == [0, 1]
    assert ranks[1]["raise"]["placeholders"] >= 2


def test_a_first_warmup_failure_with_on_error_skip_skips_the_key_on_every_rank_and_the_rest_replays(ranks):
    for rank, result in enumerate(ranks):
        done = result["skip"]
        assert done.get("value") == 6, f"rank {rank}: {done}"
        assert done["skipped"] == [GraphKey(4, 4, False), uniform(4)], f"rank {rank}"
        steps = done["steps"]
        assert [s["match"] for s in steps] == ["ok"] * 4, f"rank {rank}: {steps}"  # replays equal the reference
        assert [s["key"] for s in steps] == [uniform(1), GraphKey(3, 3, False), uniform(8), uniform(8)]
    assert [r["skip"]["completed"] for r in ranks] == [0, 2]  # uniform(4) and mixed(4)
    assert "rank 1 failed to capture it in its warmup" in ranks[0]["skip"]["reasons"][0]
    assert "(in its warmup on this rank)" in ranks[1]["skip"]["reasons"][0]


def test_a_verification_failure_whose_peer_goes_on_to_its_next_replay_is_completed_through_the_replay(ranks):
    # Rank 0 fails each eager run of verification; its peer's comparison passes (the zeros change nothing),
    # so the peer replays the next probe: rank 0 issues that replay's all-gather from what the peer's tape
    # published, then the peer's next eager run's, to the end of the peer's verification of the key.
    for rank, result in enumerate(ranks):
        done = result["verify_gather"]
        assert done["error"] == "CaptureError", f"rank {rank}: {done}"
        expected = (
            "injected failure on rank 0 before the all-gather (in its verification on this rank)"
            if rank == 0
            else "rank 0 failed to capture it in its verification; parallel ranks keep the same keys"
        )
        assert expected in done["message"], done["message"]
    # The dummy batch's eager run, then per probe level a replay and an eager run.
    assert ranks[0]["verify_gather"]["completed"] == 1 and ranks[0]["verify_gather"]["placeholders"] >= 3
    assert ranks[1]["verify_gather"]["placeholders"] == 0


def test_canary_without_the_ledger_the_peer_stays_in_the_collective_until_its_groups_timeout(ranks):
    # Rank 0's first warmup of size 4 waits in the all-reduce rank 1 never issues: only the model group's own
    # timeout (3 s here; 30 min by default) gets it out, as a gloo error of its own, not the failing rank's.
    done = ranks[0]["canary"]
    assert done["error"] == "CaptureError", done
    assert "capturing uniform(tokens=4, reqs=4) failed" in done["message"]
    assert "Timed out" in done["message"] or "timeout" in done["message"].lower(), done["message"]
    assert "rank 1 failed to capture it" not in done["message"]
    assert ranks[1]["canary"]["error"] == "CaptureError", ranks[1]["canary"]
