"""`tools/bench_padding_factor.py` prints padded replays against eager steps, by padding factor."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_padding_factor_prints_every_step_and_the_default():
    result = run_tool("bench_padding_factor.py", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines[2:] if line.split() and line.split()[0] == "8"]
    assert {(row[1], row[3]) for row in rows} == {(n, kind) for n in "8421" for kind in ("prefill", "decode")}
    assert "capture.max_padding_factor default: 4.0" in lines[-1]
