"""`tools/bench_capture.py` prints each key's capture beside its forwards, and where a re-capture pass goes."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_capture_prints_where_a_pass_goes_beside_the_goal():
    result = run_tool("bench_capture.py", "--quick", "--threads", "1", timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("capture overhead (emulated backend on cpu, 1 threads)")
    parts = out.split("where a re-capture pass goes (3 passes, each followed by an eager step of every key")[1]
    parts = parts.splitlines()
    names = [line.split("  ")[0].strip() for line in parts[2:8]]
    assert names == ["preflight", "warmups", "capture", "verification", "outside the keys (GC, report, set-up)",
                     "whole pass (median; min-max)"]  # fmt: skip
    units = [float(line.split()[-1]) for line in parts[2:6]]
    assert units[0] == 0 and all(value > 0 for value in units[1:])  # each step of every key was timed
    assert "preflight: in the emulated backend's recording (its checks run in capture)" in out
    (four,) = [line for line in out.splitlines() if line.startswith("capture pass / 4 eager forwards per key")]
    assert "per round: " in four and "; goal <= 1.5x)" in four
    (must,) = [line for line in out.splitlines() if line.startswith("capture pass / the forwards it must run")]
    units = float(must.split("per round (")[1].split()[0])
    assert units > 4 and must.endswith(")")  # the four, and the probes' replays and eager runs
    low, high = (float(x) for x in must.rsplit("(", 1)[1].rstrip(")").split("-"))
    assert 0 < low <= float(must.rsplit("x (", 1)[0].split()[-1]) <= high  # the median within the rounds' range
