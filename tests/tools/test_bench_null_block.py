"""`tools/bench_null_block.py --quick` runs and prints the null-block rule's cost per case."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_null_block_runs():
    result = run_tool("bench_null_block.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    for column in ("basic", "no rule", "rule", "p10-p90"):
        assert column in header
    rows = [line for line in lines if line.startswith(("decode", "prefill"))]
    assert [row.split("  ")[0] for row in rows] == [
        "decode 1 reqs",
        "decode 64 reqs",
        "decode 256 reqs",
        "decode 1024 reqs",
        "prefill 8 reqs, 2048 tok",
    ]
