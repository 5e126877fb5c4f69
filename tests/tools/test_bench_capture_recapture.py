"""`tools/bench_capture.py --recapture` times a first capture, a re-capture and a wake-up capture side by side."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_capture_recapture_prints_each_pass_and_what_a_recapture_keeps():
    result = run_tool("bench_capture.py", "--recapture", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("capture passes (emulated backend on cpu")
    assert [line.split()[0] for line in lines[2:5]] == ["first", "after", "after"]
    assert lines[3].startswith("after swap") and lines[4].startswith("after release")
    assert lines[-1] == (
        "kept by every re-capture: key schedule, persistent buffers, block table rows, registered statics"
    )
