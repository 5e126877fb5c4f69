"""The hot-path benchmarks run (`--quick`) and print their rows: the guard, execute, the invariant levels."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import graphcap.checks.guard
from tests.tools import REPO, TOOLS, run_tool


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


def test_bench_execute_prints_each_part_and_the_overhead_over_the_replay_beside_another_revision():
    if not (REPO / ".git").exists():
        pytest.skip("--baseline reads a git revision; this tree is not a git checkout")
    result = run_tool("bench_execute.py", "--quick", "--baseline", "HEAD", timeout=300)
    assert result.returncode == 0, result.stderr
    names = ("execute", "replay", "dispatch", "stage", "guard", "cut")
    parts = ["execute", "execute, no replay", "replay", "dispatch", "dispatch, 1 axis", "stage", "guard", "cut"]
    table, ratios = result.stdout.split("this tree over HEAD")
    assert rows(table, names) == [*parts, "execute - replay"]
    assert rows(table, ("baseline: ",)) == [f"baseline: {name}" for name in parts]
    assert rows(ratios, names) == parts
    assert "goal: execute - replay <= 12 us: " in result.stdout


def test_a_baseline_revision_is_rewritten_to_import_itself_beside_graphcap():
    sys.path.insert(0, str(TOOLS))
    try:
        import _baseline
    finally:
        sys.path.remove(str(TOOLS))
    source = (
        "import graphcap\nfrom graphcap.keys import KeyRegistry\n    from graphcap import errors\n"
        'LAZY = {"StepBatch": "graphcap.batch"}\nfiles("graphcap")\n# graphcap_x.y, mygraphcap.z, tools/graphcap.py\n'
    )
    assert _baseline.rewrite(source) == (
        "import graphcap_base\nfrom graphcap_base.keys import KeyRegistry\n    from graphcap_base import errors\n"
        'LAZY = {"StepBatch": "graphcap_base.batch"}\nfiles("graphcap_base")\n'
        "# graphcap_x.y, mygraphcap.z, tools/graphcap.py\n"
    )


def test_bench_stage_levels_prints_basic_full_and_the_rule_by_rule_checks():
    result = run_tool("bench_stage.py", "--levels", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("case"))
    assert header.split()[1:4] == ["basic", "full", "rule"]
    assert len(rows(result.stdout, ("decode", "prefill"))) == 5
    assert "goal: full at decode 256 reqs <= 25 us, i.e. <= 0.36x of the rule-by-rule checks (70 us" in result.stdout


def test_an_unknown_baseline_revision_is_one_line_naming_it():
    if not (REPO / ".git").exists():
        pytest.skip("--baseline reads a git revision; this tree is not a git checkout")
    result = run_tool("bench_execute.py", "--quick", "--baseline", "no-such-revision", timeout=300)
    assert result.returncode == 1
    assert "--baseline no-such-revision: cannot read graphcap/ at that revision" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mode", ["default-device", "device", "function-mode"])
def test_bench_execute_times_every_case_under_an_engines_torch_mode_beside_the_goal(mode):
    result = run_tool("bench_execute.py", "--quick", "--mode", mode, timeout=300)
    assert result.returncode == 0, result.stderr
    parts = ["execute", "execute, no replay", "replay", "dispatch", "dispatch, 1 axis", "stage", "guard", "cut"]
    table, ratios = result.stdout.split(f"under --mode {mode} over without it")
    assert rows(table, ("under mode: ",)) == [f"under mode: {name}" for name in parts]
    assert rows(ratios, tuple(parts)) == parts
    assert re.search(
        rf"goal: the host path under --mode {mode} within 1.2x of the same step without it: [\d.]+x", ratios
    )
