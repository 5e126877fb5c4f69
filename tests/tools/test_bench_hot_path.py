"""The hot-path benchmarks run (`--quick`) and print their rows: the guard, execute, the invariant levels."""

from __future__ import annotations

import re
from pathlib import Path

import graphcap.checks.guard
from tests.tools import run_tool


def rows(stdout: str, names: tuple[str, ...]) -> list[str]:
    return [line.split("  ")[0].strip() for line in stdout.splitlines() if line.startswith(names)]


def test_bench_guard_prints_the_checks_before_and_after_the_launch():
    result = run_tool("bench_guard.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    names = ("check_before_replay()", "check_after_replay()", "check() (both)", "data_ptr sweep only", "walk")
    assert rows(result.stdout, names)[:3] == list(names[:3])
    assert "302 static tensors (300 parameters)" in result.stdout
    assert "goal: what a replay waits for before its launch <= 5 us: check_before_replay() " in result.stdout


def test_bench_guard_times_another_guard_beside_this_one(tmp_path):
    baseline = tmp_path / "guard.py"
    baseline.write_text(Path(graphcap.checks.guard.__file__).read_text())
    result = run_tool("bench_guard.py", "--quick", "--baseline", str(baseline), timeout=300)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout, ("baseline",)) == [
        f"baseline {n}" for n in ("check_before_replay()", "check_after_replay()", "check() (both)")
    ]
    assert "vs baseline: check() (both) " in result.stdout


def test_bench_sampling_prints_each_setting_and_the_overhead_beside_its_goal():
    result = run_tool("bench_sampling.py", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout, ("sample_every",)) == ["sample_every 0", "sample_every 1000", "sample_every 1"]
    assert re.search(
        r"overhead at sample_every 1000: [\d.]+ us per step = [\d.-]+% of a step \(goal: <= 1%", result.stdout
    )


def test_bench_execute_prints_each_part_and_the_overhead_over_the_replay():
    result = run_tool("bench_execute.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    names = ("execute", "replay", "dispatch", "stage", "guard", "cut")
    expected = ["execute", "execute, no replay", "replay", "dispatch", "dispatch, 1 axis", "stage", "guard", "cut"]
    expected.append("execute - replay")
    assert rows(result.stdout, names) == expected
    assert "goal: execute - replay <= 12 us: " in result.stdout


def test_bench_stage_levels_prints_basic_full_and_the_rule_by_rule_checks():
    result = run_tool("bench_stage.py", "--levels", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("case"))
    assert header.split()[1:4] == ["basic", "full", "rule"]
    assert len(rows(result.stdout, ("decode", "prefill"))) == 5
    assert "goal: full at decode 256 reqs <= 25 us, i.e. <= 0.36x of the rule-by-rule checks (70 us" in result.stdout
