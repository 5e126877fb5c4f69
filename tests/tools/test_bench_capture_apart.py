"""`tools/bench_capture.py --apart` times re-captures with the checks in the emulated recording against passes
that run a checked preflight apart, and `--pass-threads` at one against two torch threads, interleaved."""

from __future__ import annotations

from tests.tools import run_tool


def test_bench_capture_apart_prints_both_ways_and_their_ratio():
    result = run_tool("bench_capture.py", "--apart", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("re-capture passes, the unsafe-op checks in the recording vs a checked preflight apart")
    assert [line.rsplit(maxsplit=2)[0] for line in lines[2:4]] == ["in the recording", "preflight apart"]
    assert lines[-1].startswith("in the recording / preflight apart per pair: median ")


def test_bench_capture_pass_threads_prints_one_and_two_threads_and_their_ratio():
    result = run_tool("bench_capture.py", "--pass-threads", "--quick", timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("re-capture passes, at 1 vs 2 torch threads (EMULATED_CAPTURE_THREADS), 8 graphs")
    assert [line.rsplit(maxsplit=2)[0] for line in lines[2:4]] == ["1 thread", "2 threads"]
    assert lines[-1].startswith("1 thread / 2 threads per pair: median ")
