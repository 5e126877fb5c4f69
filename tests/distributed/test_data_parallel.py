"""Data-parallel agreement across real processes: gloo, a file store, worlds of 2 and 3 ranks.

Each world is spawned once (module fixture) and runs every scenario in `_worker.run_rank`;
the tests below assert on what each rank reported. The rules: every rank replays the same
key in a step or every rank runs eagerly; an idle rank joins the agreed key; capture is in
lockstep; a rank that stops stepping surfaces as `DistributedTimeoutError`, not a hang.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from graphcap import GraphKey, load_config
from graphcap.sizing.sizes import CaptureSizes
from graphcap.testing.ranks import rank_context
from tests.distributed import _worker

WORLD_TIMEOUT_S = 240.0  # whole world, spawn to exit; a hang fails here instead of blocking CI

SIZES = CaptureSizes([1, 2, 4, 8, 16], max_num_tokens=64)


def uniform(size: int) -> GraphKey:
    return GraphKey(size, size, True)


def mixed(size: int) -> GraphKey:
    return GraphKey(size, min(size, _worker.MAX_NUM_SEQS), False)


# Scenario -> world size -> the key every rank must replay (None: every rank runs eagerly).
EXPECTED = {
    "decode_sizes": {2: uniform(8), 3: uniform(8)},  # 4 and 8 (and 2) tokens: the largest
    "one_mixed": {2: mixed(8), 3: mixed(8)},  # one mixed rank makes the key mixed
    "above_max": {2: None, 3: None},
    "idle": {2: uniform(8), 3: mixed(8)},
    "all_idle": {2: uniform(1), 3: uniform(1)},
    "idle_and_above_max": {2: None, 3: None},
}


def _spawn_world(world_size: int, directory: Path) -> list[dict]:
    ctx = rank_context()
    procs = [
        ctx.Process(target=_worker.run_rank, args=(rank, world_size, str(directory)), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    codes = [proc.exitcode for proc in procs]
    if hung or any(codes):
        pytest.fail(f"world of {world_size}: hung ranks {hung}, exit codes {codes} (every rank must exit 0)")
    results = []
    for rank in range(world_size):
        path = directory / f"rank{rank}.pkl"
        if not path.exists():
            pytest.fail(
                f"rank {rank} of {world_size} wrote no result (hung: {hung}, exit codes: {[p.exitcode for p in procs]})"
            )
        result = pickle.loads(path.read_bytes())
        if "error" in result:
            pytest.fail(f"rank {rank} of {world_size} raised:\n{result['error']}")
        results.append(result)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def world(request, tmp_path_factory) -> list[dict]:
    """Every rank's results, one spawned gloo world per world size."""
    return _spawn_world(request.param, tmp_path_factory.mktemp(f"dp{request.param}"))


def _expected_random(specs: list[_worker.Spec]) -> GraphKey | None:
    """The oracle for random steps: the agreement rules, restated apart from graphcap's code."""
    if any(spec is not None and sum(spec) > _worker.MAX_SIZE for spec in specs):
        return None
    size = max(SIZES.pad(0 if spec is None else sum(spec)) for spec in specs)
    is_uniform = all(spec is None or set(spec) == {1} for spec in specs)
    return uniform(size) if is_uniform and size <= _worker.MAX_NUM_SEQS else mixed(size)


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_every_rank_replays_the_agreed_key_or_every_rank_runs_eagerly(world, scenario):
    expected = EXPECTED[scenario][len(world)]
    for result in world:
        step = result["scripted"][scenario]
        assert (step["key"], step["ran"]) == (expected, expected), f"rank {result['rank']}: {step}"
        if expected is None:
            assert step["reason"], f"rank {result['rank']} ran eagerly without a reason"


def test_different_batch_sizes_end_on_the_largest_padded_size(world):
    keys = {r["scripted"]["decode_sizes"]["key"] for r in world}
    assert keys == {uniform(8)}  # ranks padded alone to 4, 8 (and 2)


def test_one_rank_above_max_size_makes_every_rank_run_eagerly_and_peers_count_peer(world):
    last = len(world) - 1
    for scenario in ("above_max", "idle_and_above_max"):
        reasons = [r["scripted"][scenario]["reason"] for r in world]
        assert reasons == ["peer"] * last + ["above_max_size"], scenario


def test_idle_rank_joins_the_agreed_key_and_returns_no_rows(world):
    idle = world[0]["scripted"]["idle"]
    assert idle["spec"] is None and idle["ran"] == EXPECTED["idle"][len(world)]
    assert idle["rows"] == 0 and idle["match"] == "ok"
    assert all(r["scripted"]["all_idle"]["rows"] == 0 for r in world)
    stats = world[0]["stats"]
    assert stats["graph_hits"], "the idle rank's replays count as graph hits"


def test_random_steps_agree_on_one_key_per_step(world):
    for step in range(_worker.NUM_RANDOM_STEPS):
        specs = [r["random"][step]["spec"] for r in world]
        expected = _expected_random(specs)
        got = [(r["random"][step]["key"], r["random"][step]["ran"]) for r in world]
        assert got == [(expected, expected)] * len(world), f"step {step}: specs {specs}"


def test_outputs_equal_eager_on_every_rank(world):
    for result in world:
        steps = [*result["scripted"].values(), *result["random"], result["skip"]["step"]]
        for step in steps:
            assert step["match"] == "ok", f"rank {result['rank']}, {step['spec']}: {step['match']}"
            assert step["rows"] == (0 if step["spec"] is None else sum(step["spec"]))


def test_a_rank_failing_capture_of_one_size_makes_every_rank_skip_it(world):
    failed = {uniform(_worker.FAIL_SIZE_SKIP), mixed(_worker.FAIL_SIZE_SKIP)}
    everything = set(world[0]["captured"])
    last = len(world) - 1
    for result in world:
        skip = result["skip"]
        assert set(skip["skipped"]) == failed, f"rank {result['rank']}"
        assert set(skip["captured"]) == everything - failed, f"rank {result['rank']}"
        reasons = dict(skip["report_skipped"])
        if result["rank"] == last:
            assert all(reason.startswith("out of memory") for reason in reasons.values())
        else:
            assert all(f"rank {last} failed to capture it" in reason for reason in reasons.values())
    # A step that pads to the skipped size runs eagerly everywhere: rank 0's own key is skipped.
    steps = [r["skip"]["step"] for r in world]
    assert [(s["key"], s["reason"]) for s in steps] == [(None, "skipped")] + [(None, "peer")] * last


def test_a_rank_failing_capture_under_raise_makes_every_rank_raise(world):
    for result in world:
        raised = result["raise"]
        assert raised is not None, f"rank {result['rank']} captured without error"
        assert raised["type"] == "CaptureError" and raised["num_graphs"] == 0
        assert f"tokens={_worker.FAIL_SIZE_RAISE}," in raised["message"]
        if result["rank"] == 0:
            assert "injected failure" in raised["message"]
        else:
            assert "rank 0 failed to capture it" in raised["message"]


def test_a_sticky_cuda_error_on_one_rank_stops_the_pass_on_every_rank(world):
    last = len(world) - 1
    for result in world:
        sticky = result["sticky"]
        assert sticky is not None and sticky["num_graphs"] == 0, f"rank {result['rank']} went on"
        assert f"tokens={_worker.FAIL_SIZE_SKIP}," in sticky["message"] and "restart the process" in sticky["message"]
        if result["rank"] == last:
            assert _worker.STICKY in sticky["message"]
        else:
            assert f"rank {last} hit a sticky CUDA error" in sticky["message"]


def test_ranks_with_different_configs_refuse_at_construction_naming_the_key(world):
    values = ", ".join(f"rank {rank}: {8 if rank == 0 else 16}" for rank in range(len(world)))
    for result in world:
        mismatch = result["mismatch"]
        assert mismatch is not None, f"rank {result['rank']} accepted a config its peers do not share"
        assert mismatch["keys"] == ["capture.max_size"]
        assert (
            f"capture.max_size: differs across the {len(world)} data-parallel ranks ({values})" in mismatch["message"]
        )
        assert "only device and report.path may differ" in mismatch["message"]
        assert result["per_rank_keys_agree"]


def test_a_rank_that_stops_stepping_surfaces_as_a_timeout_naming_the_step(world):
    for result in world[:-1]:
        timeout = result["timeout"]
        assert timeout is not None, f"rank {result['rank']} stepped alone without an error"
        assert timeout["message"].startswith("step 1: execute:")
        assert f"within {_worker.TIMEOUT_S:g} s on rank {result['rank']}" in timeout["message"]
        assert _worker.TIMEOUT_S - 0.5 <= timeout["seconds"] < _worker.TIMEOUT_S + 20


def test_group_without_an_initialized_process_group_is_refused():
    from graphcap import CaptureManager
    from graphcap.models import build_model

    config = load_config(overrides=_worker.CONFIG)
    with pytest.raises(ValueError, match="init_process_group"):
        CaptureManager(build_model(config), config, group=object())
