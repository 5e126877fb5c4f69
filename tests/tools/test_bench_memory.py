"""`tools/bench_memory.py --quick` and `tools/bench_startup.py --quick` run and print their tables (no timing asserts)."""

from __future__ import annotations

import sys

import pytest

from tests.tools import run_tool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bench_memory_quick_prints_estimate_and_peak():
    done = run_tool("bench_memory.py", "--quick", timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    header, row = done.stdout.splitlines()[:2]
    assert header.split() == ["config", "estimate", "alloc", "peak", "MiB", "est/alloc", "RSS", "growth", "MiB"]
    assert row.startswith("default (fp32, 2 layers, sizes to 64)")
    assert float(row.split()[-3]) >= 1.0  # the estimate over the exact allocation peak: never below
    words = row.split()
    assert words[8] == "MiB"  # the estimate, then the peak resident memory's growth (median) in MiB
    assert float(words[-2]) <= 1.2 * float(words[7])  # the process's RSS growth stays within the estimate's reach


def test_bench_startup_quick_times_every_command():
    done = run_tool("bench_startup.py", "--quick", timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    header, *rows, goal = done.stdout.splitlines()
    assert header.split()[-2:] == ["x", "bare"]  # each command beside a bare interpreter, in one process
    assert [row.split()[0] for row in rows] == ["python", "--help", "--version", "validate", "sizes"]
    assert rows[0].endswith(" 1.0x")
    assert goal.startswith("goal: graphcap --help <= 2x a bare interpreter: ")
