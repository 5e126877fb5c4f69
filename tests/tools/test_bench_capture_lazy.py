"""`tools/bench_capture.py --lazy` prints time to the first served step, upfront and lazy side by side."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_capture_lazy_prints_each_strategy_and_the_ratio_to_upfront():
    result = run_tool("bench_capture.py", "--lazy", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("time to the first served step (cpu, 1 thread(s), 8 keys, 2 rounds)")
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"upfront", "lazy", "lazy:"}
    assert len(rows["lazy"].split()) == 5 and len(rows["upfront"].split()) == 3  # lazy has its ratio to upfront
