"""`tools/bench_capture.py --apart` times re-captures with the checks in the emulated recording against passes
that run a checked preflight apart, and `--pass-threads` at one against two torch threads, interleaved."""

from __future__ import annotations

import pytest

from tests.tools import run_tool


@pytest.mark.parametrize(
    ("flag", "title", "sides"),
    [
        (
            "--apart",
            "re-capture passes, the unsafe-op checks in the recording vs a checked preflight apart",
            ["in the recording", "preflight apart"],
        ),
        (
            "--pass-threads",
            "re-capture passes, at 1 vs 2 torch threads (EMULATED_CAPTURE_THREADS), 8 graphs",
            ["1 thread", "2 threads"],
        ),
    ],
)
def test_bench_capture_prints_both_ways_and_their_ratio(flag, title, sides):
    result = run_tool("bench_capture.py", flag, "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(title)
    assert [line.rsplit(maxsplit=2)[0] for line in lines[2:4]] == sides
    assert lines[-1].startswith(f"{sides[0]} / {sides[1]} per pair: median ")
