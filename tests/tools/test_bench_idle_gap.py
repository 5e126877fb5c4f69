"""`tools/bench_idle_gap.py` prints lazy calls in an idle gap and a nothing-pending call beside a full collection."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_idle_gap_prints_each_goal_beside_its_figure():
    result = run_tool("bench_idle_gap.py", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("heap: 300,000 GC-tracked objects")
    assert "capture_pending(max_seconds=0.1) until nothing is pending (8 keys)" in out
    assert "(goal >= 1)" in out and "(goal <= 10)" in out and "goal < 2%" in out
    assert "capture_pending(), nothing pending" in out and "gc.collect() (full)" in out
    assert "of a pass" in out
