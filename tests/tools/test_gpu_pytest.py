"""gpu_check's P10 runner (tools/_gpu_pytest.py): pytest's verbose lines read back, a round that ends
inside a test (the per-test watchdog's exit, a crash) names that test and the next round runs the rest;
and P3 saves the pool against the estimate after every key (tools/_gpu_llama.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from graphcap.testing import make_config, make_manager
from tests.tools import TOOLS

sys.path.insert(0, str(TOOLS))
import _gpu_pytest  # tools/ is not a package

# test_hangs ends the process as the watchdog does (its dump in the watchdog file, exit 1), with no clock.
ROUNDS = """
import os

def test_a():
    pass

def test_hangs():
    with open(os.environ["GPU_CHECK_WATCHDOG"], "a") as dump:
        dump.write("Timeout (0:00:20)!")
    os._exit(1)

def test_crashes():
    os._exit(3)

def test_b():
    assert False, "a plain failure"

@__import__("pytest").mark.parametrize("n", [1, 2])
def test_c(n):
    pass
"""


def test_verbose_lines_give_each_outcome_and_the_test_left_running():
    stdout = "x.py::test_a PASSED [ 20%]\nx.py::test_b[1] FAILED [ 40%]\nx.py::test_c \n"
    assert _gpu_pytest.read_verbose(stdout) == ({"x.py::test_a": "PASSED", "x.py::test_b[1]": "FAILED"}, "x.py::test_c")
    assert _gpu_pytest.read_verbose("x.py::test_a PASSED [100%]\n\n1 passed")[1] is None


def test_the_command_arms_the_per_test_timeout_and_deselects_what_is_done():
    command = _gpu_pytest.round_command(["t.py"], 20.0, ["t.py::test_a"], Path("/tmp/w.txt"))
    plugin = ["-p", "no:cacheprovider", "-p", "_gpu_pytest", "--per-test-timeout=20", "--watchdog-file=/tmp/w.txt"]
    assert command[1:] == ["-m", "pytest", "-v", *plugin, "t.py", "--deselect=t.py::test_a"]


def test_a_test_that_ends_the_round_is_named_and_the_rest_still_run(tmp_path):
    (tmp_path / "test_rounds.py").write_text(ROUNDS)
    run = _gpu_pytest.run_tests(["test_rounds.py"], seconds=300, per_test=20, cwd=tmp_path)
    assert run["finished"] and run["rounds"] == 3
    assert run["outcomes"] == {
        "test_rounds.py::test_a": "PASSED",
        "test_rounds.py::test_hangs": "TIMEOUT after 20 s",
        "test_rounds.py::test_crashes": "CRASHED (exit 3)",
        "test_rounds.py::test_b": "FAILED",
        "test_rounds.py::test_c[1]": "PASSED",
        "test_rounds.py::test_c[2]": "PASSED",
    }
    assert run["stacks"]["test_rounds.py::test_hangs"].startswith("Timeout (0:00:20)!")
    summary = _gpu_pytest.summarise(run, 300)
    assert not summary["ok"] and summary["observed"].startswith("3 passed, 1 timed out, 1 crashed, 1 failed (")
    assert summary["failed"] == ["test_rounds.py::test_hangs", "test_rounds.py::test_crashes", "test_rounds.py::test_b"]


def test_a_run_with_every_test_passed_is_ok_and_one_cut_short_is_not():
    done = {"outcomes": {"t.py::a": "PASSED", "t.py::b": "SKIPPED"}, "finished": True, "rounds": 1}
    assert (
        _gpu_pytest.summarise(done, 105)["ok"] and _gpu_pytest.summarise(done, 105)["observed"] == "1 passed, 1 skipped"
    )
    cut = {**done, "finished": False}
    assert _gpu_pytest.summarise(cut, 105)["observed"].endswith("stopped after 105 s with tests left")
    assert not _gpu_pytest.summarise(cut, 105)["ok"]


def test_the_8b_pass_saves_the_pool_against_the_estimate_as_each_key_starts(monkeypatch, tmp_path):
    import _gpu_llama
    import _gpu_report

    partial = tmp_path / "partial.json"
    monkeypatch.setenv(_gpu_report.PARTIAL, str(partial))
    manager = make_manager(make_config({"capture.sizes": [1, 2, 4]}))
    saved = []

    def figures() -> dict:
        saved.append(len(manager.graphs))
        return _gpu_llama.pool_figures({"reserved_bytes": 3 << 20, "segments": 1}, 2 << 20)

    times = _gpu_llama.KeyTimes(manager, figures)
    with times.installed():
        report = manager.capture()
    record = json.loads(partial.read_text())
    assert record["pool_vs_estimate"] == 1.5 and record["pool"]["segments"] == 1
    keys = len(report.records)
    assert len(record["seconds_per_key"]) == keys and len(saved) >= keys  # saved during the pass, key by key


@pytest.fixture(autouse=True)
def _tools_modules_stay(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
