"""`tools/bench_capture.py --fills` times capture passes verified at every fill level against one level."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_capture_fills_prints_both_verifications_and_their_ratio():
    result = run_tool("bench_capture.py", "--fills", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("capture passes verified at every fill level (17 probe batches) vs one (8), 8 graphs")
    assert [line.split()[0] for line in lines[2:4]] == ["every", "one"]
    assert lines[-1].startswith("every / one per pair: median ")
