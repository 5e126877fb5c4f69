"""With data-parallel peers each rank writes its own post-mortem, named by rank, with the agreed keys of its steps.

One 2-rank gloo world (`_postmortem_worker.both_crash`), the emulated backend: both ranks' second
replay raises a device-side assert after the step's agreement.
"""

from __future__ import annotations

import pytest

from tests.distributed import _postmortem_worker as worker
from tests.distributed._spawn import spawn_world
from tests.postmortem_cases import cuda_error


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_world(worker.both_crash, 2, tmp_path_factory.mktemp("postmortem"), timeout=180.0)


def test_each_rank_writes_its_own_postmortem_named_by_rank_and_names_it_on_its_error(ranks):
    for rank, result in enumerate(ranks):
        assert result["file"].endswith(f"graphcap-postmortem.rank{rank}.json")
        kind, args, notes = result["raised"]
        assert (kind, args) == ("RuntimeError", cuda_error().args), f"rank {rank}"
        assert notes and result["file"] in notes[-1], f"rank {rank}: {notes}"
        assert (result["rank"], result["world_size"]) == (rank, 2)


def test_each_ranks_file_holds_the_agreed_keys_with_its_own_real_counts(ranks):
    real = [[s for s in result["steps"] if s[0] is not None] for result in ranks]
    assert [[(step, key) for step, key, _, _ in steps] for steps in real] == [
        [(1, "uniform(tokens=4, reqs=4)"), (2, "uniform(tokens=4, reqs=4)")]
    ] * 2  # the key both ranks agreed on
    assert [[(n, r) for _, _, n, r in steps] for steps in real] == [[(2, 2), (2, 2)], [(3, 3), (3, 3)]]
    assert all(all(result["holds"]) for result in ranks)
