"""Tensor-parallel ranks: collectives recorded on the emulated backend, the custom all-reduce, the TP check, TP x DP.

A 2-rank world runs a column/row-parallel MLP with every all-reduce spelling (`tp_group` = the
world); replays are compared with the same network in one process. A 4-rank world lays out
TP 2 x DP 2 with DP groups that report NCCL, so graphcap makes its gloo twins with local
synchronisation.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _collective_worker as worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.tensor_parallel, 2, tmp_path_factory.mktemp("tensor_parallel"))


def uniform(size: int) -> GraphKey:
    return GraphKey(size, size, True)


@pytest.mark.parametrize("spelling", ["functional", "funcol"])
def test_functional_collectives_are_recorded_and_every_replay_reduces_again(ranks, spelling):
    for rank, result in enumerate(ranks):
        done = result[spelling]
        assert done.get("value") == 8, f"rank {rank}: {done}"
        assert [step["match"] for step in done["steps"]] == ["ok"] * 4, f"rank {rank}: {done['steps']}"
        assert [step["key"] for step in done["steps"]] == [uniform(1), uniform(4), uniform(8), GraphKey(12, 1, False)]
        tape = done["tape"]
        assert "_c10d_functional::all_reduce" in tape and "_c10d_functional::wait_tensor" in tape, tape


def test_an_in_place_all_reduce_is_refused_naming_the_functional_form(ranks):
    for result in ranks:
        done = result["inplace"]
        assert done["error"] == "CaptureUnsafeError", done
        assert "c10d.allreduce_ at " in done["message"] and "distributed/_models.py:" in done["message"]
        assert "Use torch.distributed._functional_collectives.all_reduce" in done["message"]


def test_a_custom_all_reduce_asking_is_capturing_replays_the_reduced_forward(ranks):
    # Its capture() is the capture context: warmups inside it return zeros, the recording reduces.
    for rank, result in enumerate(ranks):
        done = result["custom_graphcap"]
        assert done.get("value") == 8, f"rank {rank}: {done}"
        assert [step["match"] for step in done["steps"]] == ["ok"] * 4


def test_a_custom_all_reduce_that_cannot_tell_a_warmup_from_a_recording_fails_verification(ranks):
    # Its graphs hold the zeros of a warmup; verification runs after the capture context exits, with
    # the real all-reduce, and refuses them on every rank instead of replaying wrong output.
    for result in ranks:
        done = result["custom_cuda"]
        assert done["error"] == "CaptureError", done
        assert "replay differs from eager on the same inputs" in done["message"]


def test_tp_ranks_given_different_batches_run_the_step_idle_and_raise_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        assert (result["same"]["match"], result["same"]["key"]) == ("ok", uniform(4))
        for case in ("other_size", "other_tokens"):
            refused = result[case]
            assert refused["error"] == "BatchError", f"rank {rank}, {case}: {refused}"
            assert "the tensor-parallel ranks staged different rows" in refused["message"]
            assert refused["key"] == uniform(1)  # both ran the same idle step: their collectives paired
        assert (result["same_again"]["match"], result["same_again"]["key"]) == ("ok", uniform(8))


def test_tp_by_dp_groups_agree_steps_and_failures_across_the_grid(tmp_path):
    results = spawn_world(worker.grid, 4, tmp_path, timeout=360.0)
    for rank, result in enumerate(results):
        assert result["dp_only"] is None  # both DP groups agreed (nothing captured: eager)
        assert result["twin_is_new"] and result["twin_ranks"] == [rank % 2, rank % 2 + 2]
        assert result["reduced"] == [rank % 2 + 2]
        # Rank 1 failed size 4: its TP peer learns it in the TP agreement, its DP peer in the DP one.
        assert result["skipped"] == [GraphKey(4, 4, False), uniform(4)], f"rank {rank}"
        assert len(result["captured"]) == 6
        steps = result["steps"]
        assert [step["match"] for step in steps] == ["ok"] * 3, f"rank {rank}: {steps}"
        assert [step["key"] for step in steps[:2]] == [uniform(8), uniform(2)]
        assert steps[2]["key"] == (GraphKey(5, 5, False) if rank < 2 else GraphKey(12, 1, False))  # eager
