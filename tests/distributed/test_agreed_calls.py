"""Calls that change the live graphs are collective; eager steps pad by default when the forward holds a collective.

One 2-rank gloo world (`_lifecycle_worker.agreed_calls`), the emulated backend, a forward with a
DP all-gather. The rules: `release()`, `reset()` and `resize_kv()` made on one rank fail at once
on every rank, naming each rank's call, and change nothing; a `resize_kv` refused on one rank
raises on every rank and no rank releases its graphs; with `Parallel.pad_eager` left at None an
eager step pads to the largest counts once a captured graph holds a collective (an unpadded
all-gather of different shapes aborts gloo); lazy demand counts the agreed key only.
"""

from __future__ import annotations

import pytest

from graphcap import GraphKey
from tests.distributed import _lifecycle_worker as worker
from tests.distributed._spawn import spawn_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.agreed_calls, 2, tmp_path_factory.mktemp("agreed_calls"), timeout=300.0)


def uniform(size: int) -> GraphKey:
    return GraphKey(size, size, True)


def test_a_release_on_one_rank_fails_at_once_on_every_rank_naming_each_call(ranks):
    for rank, result in enumerate(ranks):
        done = result["release_alone"]
        assert done["error"] == "DistributedTimeoutError", f"rank {rank}: {done}"
        assert "ranks out of step" in done["message"]
        assert "rank 0: release() after step 2; rank 1: execute() of step 3" in done["message"]
        graphs, step = result["after_release_alone"]
        assert graphs == result["graphs"] == 8  # nothing was released
        assert (step["match"], step["key"]) == ("ok", uniform(4)), f"rank {rank}: {step}"


@pytest.mark.parametrize(("scenario", "call"), [("reset_alone", "reset()"), ("resize_alone", "resize_kv()")])
def test_reset_and_resize_kv_on_one_rank_fail_on_every_rank(ranks, scenario, call):
    lone = 1 if scenario == "reset_alone" else 0
    for rank, result in enumerate(ranks):
        done = result[scenario]
        assert done["error"] == "DistributedTimeoutError", f"rank {rank}: {done}"
        assert f"rank {lone}: {call} after step 3" in done["message"]
        assert f"rank {1 - lone}: execute() of step 4" in done["message"]


def test_a_resize_kv_refused_on_one_rank_raises_on_every_rank_and_keeps_every_graph(ranks):
    refused, peer = ranks[1]["resize_refused"], ranks[0]["resize_refused"]
    assert refused["error"] == "ConfigError" and "kv_cache" in refused["message"], refused
    assert peer["error"] == "DistributedTimeoutError", peer
    assert "resize_kv() after step 3: rank 1 refused it" in peer["message"]
    for rank, result in enumerate(ranks):
        assert result["graphs_after_refusal"] == 8
        step = result["step4"]
        assert (step["match"], step["key"]) == ("ok", uniform(4)), f"rank {rank}: {step}"


def test_eager_steps_pad_by_default_when_a_captured_graph_holds_a_collective(ranks):
    for rank, result in enumerate(ranks):
        assert result["pads"] is True
        step = result["eager_skewed"]  # 2 decodes and a 12-token prefill: above the largest size
        assert step["match"] == "ok", f"rank {rank}: {step}"
        assert step["key"] == GraphKey(12, 2, False)  # padded to the largest counts on both ranks
        assert result["pads_before_capture"] is True  # nothing recorded yet: the safe side
        assert result["pads_without_collectives"] is False  # a forward without collectives runs its own count


def test_a_release_made_by_every_rank_is_agreed_and_later_steps_run_eagerly(ranks):
    for rank, result in enumerate(ranks):
        assert result["release_both"] == {"value": 8}
        step = result["after_release"]
        assert step["match"] == "ok" and step["key"] == GraphKey(5, 5, False), f"rank {rank}: {step}"
        assert result["eager_reasons"]["released"] == 1


def test_lazy_demand_counts_the_agreed_key_not_each_ranks_own(ranks):
    for rank, result in enumerate(ranks):
        # Rank 0's own uniform(1) never ran: only the agreed size counts (its uniform key and the mixed fallback).
        assert result["demand"] == {str(uniform(4)): 3, str(GraphKey(4, 4, False)): 3}, f"rank {rank}"
        assert result["first_lazy"] == (1, [str(uniform(4))])


def test_a_graph_of_the_agreed_key_serves_though_a_ranks_own_key_is_pending(ranks):
    for rank, result in enumerate(ranks):
        step = result["agreed_serves"]  # rank 0: 1 decode (uniform(1) pending), rank 1: 3 decodes
        assert step["match"] == "ok", f"rank {rank}: {step}"
        assert step["key"] == uniform(4) and step["hits"] == 1, f"rank {rank}: {step}"


@pytest.mark.parametrize(
    ("scenario", "call", "after"),
    [("capture_refused", "capture() starting", 4), ("pending_refused", "capture_pending() starting", 4)],
)
def test_a_capture_refused_on_one_rank_before_it_agrees_raises_on_every_rank(ranks, scenario, call, after):
    refused, peer = ranks[1][scenario], ranks[0][scenario]
    assert refused["error"] == "ValueError" and "999" in refused["message"], refused
    assert peer["error"] == "DistributedTimeoutError", peer
    assert f"{call} after step {after}: rank 1 refused it" in peer["message"], peer["message"]
    for rank, result in enumerate(ranks):
        step = result["after_capture_refused" if scenario == "capture_refused" else "after_pending_refused"]
        assert step["match"] == "ok" and step["key"] == uniform(4), f"rank {rank}: {step}"
    assert [result["graphs_after_capture_refused"] for result in ranks] == [8, 8]
    assert [result["pending_refused"]["graphs"] for result in ranks] == [1, 1]
