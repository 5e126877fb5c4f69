"""`capture.memory_budget` with tensor-parallel ranks whose graphs differ in size: admission is agreed.

One 2-rank gloo world (`_budget_worker.admitted`): a vocab-parallel head split unevenly (80 and
48 logits columns), a budget between the two ranks' totals. Decided per rank, the larger rank
would decline keys its peer keeps, and a step would replay on one rank what runs eagerly on the
other (gloo pairs the two forwards' collectives and aborts). Every rank keeps a key only if
every rank can.
"""

from __future__ import annotations

from tests.distributed import _budget_worker as worker
from tests.distributed._spawn import spawn_world


def test_every_rank_keeps_the_keys_every_rank_admits_and_steps_replay_alike(tmp_path):
    ranks = spawn_world(worker.admitted, 2, tmp_path, timeout=240.0)
    totals = ranks[0]["totals"]
    assert totals[0] > totals[1], totals  # the canary: rank 0's graphs are larger, the budget lies between
    assert ranks[0]["captured"] == ranks[1]["captured"], [result["captured"] for result in ranks]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] != [], [result["skipped"] for result in ranks]
    for rank, result in enumerate(ranks):
        assert "value" in result["capture"], f"rank {rank}: {result['capture']}"
        for step in result["steps"]:
            assert step.get("match") is True, f"rank {rank}: {step}"
        assert [step["key"] for step in result["steps"]] == [step["key"] for step in ranks[0]["steps"]]
