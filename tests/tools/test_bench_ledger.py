"""`tools/bench_ledger.py --quick` runs end to end (two gloo ranks) and prints its table; no timing asserts."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_ledger_quick_prints_each_variant_and_the_descriptors_a_pass_publishes():
    done = run_tool("bench_ledger.py", "--rounds", "1", "--layers", "2", timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for row in ("with the ledger", "watched, nothing sent", "without the ledger"):
        assert row in done.stdout, done.stdout
    assert "descriptors published per pass: " in done.stdout and "store.set alone" in done.stdout
