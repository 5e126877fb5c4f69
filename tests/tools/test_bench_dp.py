"""`tools/bench_dp.py --quick` runs end to end (two gloo ranks) and prints its table; no timing asserts."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_dp_quick_prints_the_step_and_its_agreement_side_by_side():
    done = run_tool("bench_dp.py", "--quick", timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for row in (
        "execute, no group: 24 decodes (the step)",
        "dist.all_reduce 13 x int64",
        "GroupSync.agree (the agreement)",
        "execute, DP: 24 decodes on both ranks",
        "execute, DP: rank 0 restaged to rank 1's key",
        "execute, TP: 24 decodes (digest + 2 agreements)",
    ):
        assert row in done.stdout, done.stdout
    assert "agreed mixed(tokens=40, reqs=32)" in done.stdout
    assert "pairs, interleaved call by call: GroupSync.agree" in done.stdout
    assert "agreement / all-reduce per pair: median" in done.stdout
