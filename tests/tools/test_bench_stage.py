"""`tools/bench_stage.py --quick` runs and prints its table."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_stage_runs():
    result = run_tool("bench_stage.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    for column in ("graphcap med", "p90", "python med", "speedup"):
        assert column in header
    rows = [line for line in lines if line.startswith(("decode", "prefill"))]
    assert [row.split("  ")[0] for row in rows] == [
        "decode 1 reqs",
        "decode 64 reqs",
        "decode 256 reqs",
        "decode 1024 reqs",
        "prefill 8 reqs, 2048 tok",
    ]


def test_bench_stage_groups_compares_a_kv_group_with_its_engine_buffer_form():
    result = run_tool("bench_stage.py", "--groups", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    for column in ("group med", "buffers med", "ratio", "round ratio p10-p90"):
        assert column in header
    rows = [line for line in lines if line.startswith("decode")]
    assert [row.split("  ")[0] for row in rows] == [f"decode {n} reqs" for n in (1, 8, 64, 256, 1024)]
