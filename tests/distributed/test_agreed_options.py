"""What ranks build their managers with is agreed: `Parallel` options, and names made from per-process order.

One 2-rank gloo world (`_agreed_worker.draft_then_tp`), the emulated backend. A manager with peers
that rank 0 alone makes (a TP=1 draft model's) must not shift the names of a later manager's gloo
twin or ledger on that rank (a wrong twin name waits in the store's rendezvous; a wrong ledger
name leaves the failing rank blind to what its peer waits in). DP ranks built with different
`pad_eager` or `token_counts` (an eager step's collectives would differ in shape: gloo aborts)
raise the same `ConfigError` at construction, naming the option and each rank's value. A TP
rank whose step is refused after the agreements (its `prepare` breaks a row) makes its peer
raise too, naming it, instead of the peer's replay reducing with the idle rank's padding rows.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _agreed_worker as worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.draft_then_tp, 2, tmp_path_factory.mktemp("agreed_options"), timeout=240.0)


def test_a_manager_one_rank_alone_makes_leaves_later_twins_and_ledgers_named_alike(ranks):
    assert ranks[0]["draft_ledger"] == 0
    for rank, result in enumerate(ranks):
        assert result["tp_made"] == {}, f"rank {rank}: {result['tp_made']}"
        assert result["tp_ledger"] == 1, f"rank {rank}"  # the largest serial any rank proposed
        done = result["tp_capture"]
        assert "value" in done, f"rank {rank}: {done}"
        # Rank 1 failed the first warmup of size 4: it followed its peer's collectives, both skipped the keys.
        assert done["skipped"] == [GraphKey(4, 4, False), GraphKey(4, 4, True)], f"rank {rank}: {done}"
        assert done["completed"] == (2 if rank == 1 else 0), f"rank {rank}: {done}"
        for step in done["steps"]:
            assert step["match"] == "ok", f"rank {rank}: {step}"
        assert done["steps"][0]["key"] == GraphKey(2, 2, True)


@pytest.mark.parametrize(
    ("case", "shown"),
    [
        ("pad_eager", "rank 0: True, rank 1: False"),
        ("token_counts", "rank 0: True, rank 1: False"),
        ("pad_eager_unset", "rank 0: None, rank 1: True"),
    ],
)
def test_dp_ranks_built_with_different_options_raise_the_same_config_error(ranks, case, shown):
    option = case.removesuffix("_unset")
    messages = set()
    for rank, result in enumerate(ranks):
        refused = result[case]
        assert refused["error"] == "ConfigError", f"rank {rank}: {refused}"
        assert f"Parallel.{option}: differs across the 2 data-parallel ranks ({shown})" in refused["message"]
        assert f"every rank must pass the same Parallel({option}=...)" in refused["message"]
        messages.add(refused["message"])
    assert len(messages) == 1  # every rank raises the same error


def test_the_same_options_on_every_rank_build_and_step(ranks):
    for rank, result in enumerate(ranks):
        step = result["same"]
        assert step["match"] == "ok", f"rank {rank}: {step}"
        assert step["key"] == GraphKey(12, 1, False)  # padded to the largest count on both ranks
        assert step["seen"] == [9, 12]


@pytest.mark.parametrize(("case", "key"), [("replay", GraphKey(2, 2, True)), ("eager", GraphKey(12, 1, False))])
def test_a_tp_rank_refused_after_the_agreement_makes_its_peer_raise_naming_it(ranks, case, key):
    refused, peer = ranks[1]["tp_refused"][case], ranks[0]["tp_refused"][case]
    assert refused["error"] == "InvariantViolation", refused
    assert peer["error"] == "BatchError", peer  # never a wrong output: its replay would reduce with padding
    assert "the batch of tensor-parallel rank 1 was refused after the agreement" in peer["message"]
    assert "every rank of the tensor-parallel group ran this step idle" in peer["message"]
    for rank, result in enumerate(ranks):
        again = result["tp_refused"][f"{case}_again"]  # the same step on both ranks: runs, equals the reference
        assert again["match"] == "ok", f"rank {rank}: {again}"
        assert again["key"] == key, f"rank {rank}: {again}"


def test_sampled_steps_are_counted_once_per_agreed_step_after_a_refusal(ranks):
    for number in range(5):
        counted = [(result["sampled"][number]["replays"], result["sampled"][number]["checked"]) for result in ranks]
        assert counted[0] == counted[1] == (number + 1, (number + 1) // 2), f"step {number + 1}: {counted}"
    for rank, result in enumerate(ranks):
        for number, step in enumerate(result["sampled"], 1):
            if (rank, number) == (1, 2):
                assert step["error"] == "InvariantViolation", step
            else:
                assert step["match"] == "ok" and step["key"] == GraphKey(4, 4, True), f"rank {rank}: {step}"


def test_a_static_input_replaced_on_one_dp_rank_is_refused_before_the_agreement(ranks):
    moved, peer = ranks[1]["moved"]["moved"], ranks[0]["moved"]["moved"]
    assert moved["error"] == "StaticInputMovedError", moved
    assert peer.get("match") == "ok" and peer["eager"] == {"peer": 1}, peer  # the reference output, eagerly
    for rank, result in enumerate(ranks):
        restored = result["moved"]["restored"]  # put back: both ranks replay again
        assert restored["match"] == "ok" and restored["key"] == GraphKey(4, 4, True), f"rank {rank}: {restored}"
