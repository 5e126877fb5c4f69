"""Tensor-parallel ranks: collectives recorded on the emulated backend, the custom all-reduce, the TP check, TP x DP.

A 2-rank world runs a column/row-parallel MLP with every all-reduce spelling (`tp_group` = the
world); replays are compared with the same network in one process. A 4-rank world lays out
TP 2 x DP 2 with DP groups that report NCCL, so graphcap makes its gloo twins over each group's
ranks alone.
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


@pytest.mark.parametrize("spelling", ["functional", "funcol", "custom_stream"])
def test_functional_collectives_are_recorded_and_every_replay_reduces_again(ranks, spelling):
    for rank, result in enumerate(ranks):
        done = result[spelling]
        assert done.get("value") == 8, f"rank {rank}: {done}"
        assert [step["match"] for step in done["steps"]] == ["ok"] * 4, f"rank {rank}: {done['steps']}"
        assert [step["key"] for step in done["steps"]] == [uniform(1), uniform(4), uniform(8), GraphKey(12, 1, False)]
        if spelling == "custom_stream":  # the custom all-reduce given as capture_context: its placeholders never
            continue  # reach the graph (the emulated backend answers the stream query as CUDA does)
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
        # One rank's other config: every rank of the grid gets the ConfigError naming the field and both values.
        refused = result["config"]
        assert refused["error"] == "ConfigError", f"rank {rank}: {refused}"
        assert "capture.sizes: differs across the 4 " in refused["message"]
        assert "rank 0: [1, 2, 4], rank 1: [1, 2, 4, 8]" in refused["message"], refused["message"]
        assert result["dp_only"] is None  # both DP groups agreed (nothing captured: eager)
        assert result["twin_is_new"] and result["twin_ranks"] == [rank % 2, rank % 2 + 2]
        assert result["reduced"] == [rank % 2 + 2]
        # Rank 1 failed the first warmup of size 4 before its all-reduce: it issued its TP peer's collectives, and
        # its TP peer learns it in the TP agreement, its DP peer in the DP one.
        assert result["skipped"] == [GraphKey(4, 4, False), uniform(4)], f"rank {rank}"
        assert result["completed"] == (2 if rank == 1 else 0), f"rank {rank}"
        assert len(result["captured"]) == 6
        steps = result["steps"]
        assert [step["match"] for step in steps] == ["ok"] * 3, f"rank {rank}: {steps}"
        assert [step["key"] for step in steps[:2]] == [uniform(8), uniform(2)]
        # Eager (12 tokens is above the largest size), padded to the largest counts of the DP ranks (5 decodes,
        # a 12-token prefill): the captured forward holds collectives, so Parallel.pad_eager (None) pads.
        assert steps[2]["key"] == GraphKey(12, 5, False)


def test_an_engine_capture_mode_wrapped_around_capture_fails_verification_naming_it(ranks):
    # The custom all-reduce asks torch.cuda.is_current_stream_capturing(): True only while the emulated
    # backend records, so the graph reduces while the eager reference (still in the engine's mode) does not.
    for rank, result in enumerate(ranks):
        done = result["wrapped"]
        assert done["error"] == "CaptureError", f"rank {rank}: {done}"
        assert "replay differs from eager" in done["message"]
        assert "The forward holds collectives" in done["message"]
        assert "An engine must not wrap capture() in its own capture mode" in done["message"]


def test_canary_without_the_stream_answer_every_key_verifies_and_replays_are_wrong(ranks):
    for rank, result in enumerate(ranks):
        done = result["wrapped_unanswered"]
        assert done.get("value") == 8, f"rank {rank}: {done}"  # placeholders everywhere: "verified"
        assert all(step["match"] != "ok" for step in done["steps"]), f"rank {rank}: {done['steps']}"


def test_after_a_refused_tp_step_identical_smaller_steps_replay(ranks):
    for rank, result in enumerate(ranks):
        refused = result["refused_big"]
        assert refused["error"] == "BatchError", f"rank {rank}: {refused}"
        # Rank 0 staged 8 rows its peer did not: the digest covers the key's rows only, so 1 and 2 decodes agree.
        small = result["small_after"]
        assert [(s.get("match"), s["key"]) for s in small] == [("ok", uniform(1)), ("ok", uniform(2))], small


def test_a_refused_tp_rank_names_its_own_reason_and_each_failure_its_own_step(ranks):
    first, second = ranks[0]["refused_twice"]
    assert "this rank's batch was refused" in first["message"] and "block" in first["message"], first
    assert first["message"].startswith("step 8: ") and second["message"].startswith("step 9: "), (first, second)
    peer = ranks[1]["refused_twice"]
    assert [p["message"][:8] for p in peer] == ["step 8: ", "step 9: "]
    assert all("this rank's batch was refused" not in p["message"] for p in peer)


def test_a_rank_failing_before_its_collective_in_a_recording_lets_every_rank_skip_the_key(ranks):
    # Rank 1 raises before its all-reduce while size 4 records; it issues the all-reduce its warmup issued
    # (zeros), so rank 0's recording completes, and both skip the key in the agreement after it.
    for rank, result in enumerate(ranks):
        done = result["fail_recording"]
        assert done.get("value") == 6, f"rank {rank}: {done}"
        assert done["skipped"] == [GraphKey(4, 4, False), uniform(4)]
        assert [(s["match"], s["key"]) for s in done["steps"]] == [("ok", GraphKey(3, 3, False)), ("ok", uniform(8))]
    assert [r["fail_recording"]["completed"] for r in ranks] == [0, 2]  # uniform(4) and mixed(4)
    assert "rank 1 failed to capture it in its recording" in ranks[0]["fail_recording"]["reasons"][0]
    assert "(in its recording on this rank)" in ranks[1]["fail_recording"]["reasons"][0]


def test_a_rank_failing_before_its_collective_in_verification_raises_on_every_rank_naming_it(ranks):
    for rank, result in enumerate(ranks):
        done = result["fail_verify"]
        assert done["error"] == "CaptureError", f"rank {rank}: {done}"
        assert "capturing uniform(tokens=8, reqs=8) failed" in done["message"]
        expected = (
            "injected failure on rank 0 before the all-reduce (in its verification on this rank)"
            if rank == 0
            else "rank 0 failed to capture it in its verification; parallel ranks keep the same keys; this rank's "
            "verification failed after it"  # its eager reference reduced with rank 0's zeros
        )
        assert expected in done["message"], done["message"]
    assert [r["fail_verify"]["completed"] for r in ranks] == [1, 0]
