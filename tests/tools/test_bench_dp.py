"""`tools/bench_dp.py --quick` runs end to end (two gloo ranks) and prints its table; no timing asserts."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_dp_quick_prints_every_row():
    done = run_tool("bench_dp.py", "--quick", timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    for row in ("KeyRegistry.dispatch", "dist.all_reduce", "DataParallelSync.reduce_max", "dispatch (DP step)"):
        assert row in done.stdout, done.stdout
    assert "agreed mixed(tokens=40, reqs=32)" in done.stdout
