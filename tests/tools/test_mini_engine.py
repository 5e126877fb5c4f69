"""`tools/mini_engine.py`: a continuous-batching engine on the public API; graph == eager == dense every step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import deque

import pytest

from graphcap import InvariantViolation
from tests.tools import REPO, TOOLS, run_tool

sys.path.insert(0, str(TOOLS))

import mini_engine


def _refused(capsys, *args: str) -> str:
    """`mini_engine.main(args)` in this process: an argument error exits 2 (argparse) before any work; its stderr."""
    with pytest.raises(SystemExit) as exited:
        mini_engine.main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_a_short_run_agrees_every_step_and_prints_its_summary():
    result = run_tool("mini_engine.py", "--steps", "60", "--seed", "1", "--quiet", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "every step: graph == eager == dense logits, identical token streams" in out
    replayed, eager, idle = map(int, re.search(r"steps replayed: (\d+); eager: (\d+) .*; idle .*: (\d+)", out).groups())
    assert replayed + eager + idle == 60 and idle == 3, out  # every step of the run counted once
    preempted = int(re.search(r"preemptions \(recompute\): (\d+)", out).group(1))
    finished = int(re.search(r"(\d+) finished", out).group(1))
    assert replayed > 40 and preempted >= 1 and finished >= 10, out
    assert re.search(r"padded-token waste of replayed steps: \d+\.\d%", out)


@pytest.fixture(scope="module")
def baseline_digest() -> str:
    """The token streams of a 45-step run that never re-captured."""
    result = run_tool("mini_engine.py", "--steps", "45", "--seed", "1", "--quiet", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return re.search(r"token streams digest: (\w+)", result.stdout).group(1)


def test_a_recapture_with_requests_in_flight_leaves_the_token_streams_unchanged(baseline_digest):
    """Two re-captures mid-run, live blocks in flight: every step still agrees and the streams are identical."""
    extra = ("--recapture-at", "15", "--recapture-at", "31")
    result = run_tool("mini_engine.py", "--steps", "45", "--seed", "1", "--quiet", *extra, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(2 re-captures)" in result.stdout
    assert re.search(r"token streams digest: (\w+)", result.stdout).group(1) == baseline_digest


def test_an_engines_whole_lifecycle_leaves_the_token_streams_unchanged(baseline_digest):
    """Weight swap refused, re-capture, release and wake, KV grown, a second KV group: the same streams."""
    result = run_tool("mini_engine.py", "--steps", "45", "--seed", "1", "--lifecycle", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out, events = result.stdout, result.stderr
    assert re.search(r"token streams digest: (\w+)", out).group(1) == baseline_digest
    assert "lifecycle: 1 weight swap refused by the guard, 5 captures, 2 releases" in out, out
    assert "KV cache grown to 60 blocks, a second KV group throughout" in out
    assert re.search(r"eager: 3 \(\{'released': 3\}\)", out), out
    for event in ("the guard refused the replay (model.llama.lm_head was replaced)", "captured again with",
                  "released 11 graphs", "woke, captured 11 graphs", "KV cache grown to 60 blocks"):  # fmt: skip
        assert event in events, events


def test_an_engine_that_hands_out_the_null_block_is_stopped_before_the_model_runs(monkeypatch):
    """The engine's side of the contract: block 0 is graphcap's. A pool that hands it out is caught."""
    monkeypatch.setattr(mini_engine.BlockPool, "__init__", lambda self, n: setattr(self, "free", deque(range(n))))
    with pytest.raises(
        InvariantViolation,
        match=r"request \d+ (reads|writes this step's keys into) the null block 0|slot lies in block 0",
    ):
        mini_engine.main(["--steps", "20", "--seed", "0", "--quiet"])


def test_steps_must_be_positive(capsys):
    assert "--steps must be >= 1; got 0" in _refused(capsys, "--steps", "0")


def test_lifecycle_needs_room_for_its_events(capsys):
    assert "--lifecycle needs --steps >= 12" in _refused(capsys, "--steps", "8", "--lifecycle")


def test_recapture_at_must_be_a_step_of_the_run(capsys):
    assert "--recapture-at must be a step in [0, 10); got 10" in _refused(
        capsys, "--steps", "10", "--recapture-at", "10"
    )


def _digests(*args: str) -> tuple[list[str], str]:
    result = run_tool("mini_engine.py", "--steps", "20", "--quiet", *args, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return re.findall(r"token streams digest: (\w+)", result.stdout), result.stdout + result.stderr


def test_tensor_and_data_parallel_runs_sample_the_single_process_token_streams():
    """TP=2 x DP=2 on gloo (each replica two TP ranks with real all-reduces in every layer): each replica's
    streams equal one process's with its seed."""
    single = [_digests("--seed", str(seed))[0][0] for seed in (1, 2)]
    digests, printed = _digests("--seed", "1", "--tp", "2", "--dp", "2")
    assert digests == single
    assert re.search(r"20 steps replayed \(\d+ of them idle: nothing scheduled", printed), printed


def test_a_parallel_run_leaks_no_semaphores():
    """Each rank's multiprocessing finalizers run (tqdm's write lock is a semaphore): the resource tracker, which
    reports leaks as the tool's process ends, says nothing. A fresh interpreter, not the tool server, so the
    tracker's last words reach the captured stderr."""
    argv = [sys.executable, str(TOOLS / "mini_engine.py"), "--steps", "3", "--seed", "1", "--tp", "2", "--dp", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "leaked" not in result.stderr and result.stderr == "", result.stderr


def test_parallel_flags_are_checked(capsys):
    assert "--tp must be 1, 2 or 4 and --dp >= 1; got --tp 3 --dp 1" in _refused(capsys, "--tp", "3")
    refused = _refused(capsys, "--dp", "2", "--recapture-at", "1")
    assert "--recapture-at, --lifecycle and --lora run in one process" in refused
    assert "--recapture-at, --lifecycle and --lora run in one process" in _refused(capsys, "--tp", "2", "--lifecycle")


def test_lora_slots_as_a_key_axis_give_the_token_streams_of_an_eager_run(monkeypatch):
    """`--lora`: the slot count is a key axis; every step agrees, and the streams equal a run with no graphs."""
    graphs = mini_engine.run(40, 1, lora=True)
    stats = graphs.manager.stats
    slots = {dict(key.axes)["lora"] for key in stats.graph_hits}
    assert len(slots) >= 2 and slots <= {0, 1, 2, 4}  # steps replayed graphs of several slot counts
    assert stats.eager["above_max_axis.lora"] >= 1  # and a step of more adapters than 4 slots ran eagerly
    monkeypatch.setitem(mini_engine.CONFIG, "capture.mode", "none")
    eager = mini_engine.run(40, 1, lora=True)
    assert set(eager.manager.stats.eager) == {"mode_none"} and not eager.manager.graphs
    assert eager.digest == graphs.digest


def test_lora_runs_in_one_process(capsys):
    assert "--lora run in one process" in _refused(capsys, "--steps", "5", "--lora", "--dp", "2")
