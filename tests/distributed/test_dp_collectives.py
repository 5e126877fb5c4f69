"""Data-parallel ranks whose forward holds a collective (a DP all-gather): no rank strands its peers.

Two gloo ranks, the emulated backend (the all-gather is recorded on the tape and runs on every
replay). The rules: eager steps can pad to one token count on every rank and the model reads
every rank's count; a batch refused before or after the agreement runs the step idle, so the
peer completes it, then raises; ranks out of step fail at the first mismatched call with "ranks
out of step", naming each rank's call; a collective error inside a step (a peer died) is a
`DistributedTimeoutError` naming the step and the key.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _collective_worker as worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.data_parallel, 2, tmp_path_factory.mktemp("dp_collectives"))


def uniform(size: int) -> GraphKey:
    return GraphKey(size, size, True)


def test_replays_and_idle_ranks_read_every_ranks_token_count(ranks):
    for rank, result in enumerate(ranks):
        assert result["graphs"] == 8
        graph, idle = result["graph"], result["idle"]
        assert (graph["match"], graph["key"], graph["seen"]) == ("ok", uniform(8), [3, 6]), f"rank {rank}"
        assert (idle["match"], idle["key"], idle["seen"]) == ("ok", uniform(4), [3, 0]), f"rank {rank}"


def test_an_eager_step_pads_to_the_largest_count_on_every_rank_so_the_collective_pairs(ranks):
    # Rank 1's 9 tokens are above the largest size: every rank runs eagerly, padded to 9 tokens and
    # 3 requests, so the all-gather in the forward has one shape everywhere (unpadded: SIGABRT in gloo).
    for rank, result in enumerate(ranks):
        eager = result["eager"]
        assert (eager["match"], eager["key"], eager["seen"]) == ("ok", GraphKey(9, 3, False), [3, 9]), f"rank {rank}"
    assert ranks[0]["stats"]["eager"] == {"peer": 1} and ranks[1]["stats"]["eager"] == {"above_max_size": 1}


def test_a_batch_refused_before_the_agreement_runs_the_step_idle_then_raises(ranks):
    ok, refused = ranks[0]["refused"], ranks[1]["refused"]
    assert (ok["match"], ok["key"]) == ("ok", uniform(4))  # rank 1 joined as an idle rank
    assert refused["error"] == "BatchError" and "block_table[0, 0] is 999" in refused["message"], refused
    assert refused["key"] == uniform(4) and refused["seen"] == [3, 0]


def test_a_step_refused_after_the_agreement_runs_idle_then_raises(ranks):
    ok, refused = ranks[0]["refused_after"], ranks[1]["refused_after"]
    assert (ok["match"], ok["key"], ok["seen"]) == ("ok", uniform(8), [2, 5])
    assert refused["error"] == "InvariantViolation" and "seq_lens" in refused["message"], refused
    assert refused["key"] == uniform(8)
    for result in ranks:  # and the next step is a normal one on both
        assert (result["after_refusals"]["match"], result["after_refusals"]["key"]) == ("ok", uniform(4))


def test_a_rank_that_skipped_a_step_fails_the_first_mismatched_call_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        skipped = result["engine_steps"]
        assert skipped["error"] == "DistributedTimeoutError", skipped
        message = skipped["message"]
        assert f"step {10 + rank}: execute: ranks out of step: the data-parallel ranks made different calls" in message
        assert "rank 0: execute() of step 10; rank 1: execute() of step 11" in message
        assert "No rank ran the step" in message
        assert result["engine_steps_again"]["match"] == "ok"  # the ranks agree again at step 12


def test_a_rank_capturing_while_its_peer_steps_fails_on_both_ranks_and_keeps_its_graphs(ranks):
    for result in ranks:
        mismatch = result["mismatch"]
        assert mismatch["error"] == "DistributedTimeoutError", mismatch
        assert "rank 0: capture() starting after step 12; rank 1: execute() of step 13" in mismatch["message"]
        assert result["graphs_after_mismatch"] == 8
        assert (result["after_mismatch"]["match"], result["after_mismatch"]["key"]) == ("ok", uniform(8))


def test_a_rank_capturing_pending_keys_while_its_peer_steps_is_named_as_calling_capture_pending(ranks):
    for result in ranks:
        mismatch = result["pending_mismatch"]
        assert mismatch["error"] == "DistributedTimeoutError", mismatch
        assert "rank 0: capture_pending() starting after step 13; rank 1: execute() of step 14" in mismatch["message"]
        assert (
            "(capture(), capture_pending(), release(), resize_kv(), reset()) at the same point" in mismatch["message"]
        )


def test_a_collective_error_inside_a_step_names_the_step_and_the_key(tmp_path):
    # Rank 1 dies after the agreement of step 2, before the graph's all-gather: rank 0's replay fails
    # inside the collective (gloo: connection closed) and says which step and key, instead of a raw
    # gloo error or the process group's timeout.
    first, dead = spawn_world(worker.data_parallel_death, 2, tmp_path, exits={1: -9})
    assert dead is None
    assert first["first"]["match"] == "ok"
    second = first["second"]
    assert second["error"] == "DistributedTimeoutError", second
    assert second["message"].startswith("step 2: uniform(tokens=4, reqs=4): a collective inside the forward failed")
    assert "restart the ranks" in second["message"]
