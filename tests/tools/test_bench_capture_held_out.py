"""`tools/bench_capture.py --held-out` prints in-sample and held-out waste beside the ladder's, and the goal."""

from __future__ import annotations

from graphcap.testing.traffic import TRAFFIC_SHAPES
from tests.tools import run_tool


def test_bench_capture_held_out_prints_a_row_per_shape_and_graph_count_and_the_goal():
    result = run_tool("bench_capture.py", "--held-out", "--seeds", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in TRAFFIC_SHAPES]
    assert [(row[0], row[2]) for row in rows] == [(shape, n) for shape in TRAFFIC_SHAPES for n in ("30", "51")]
    for row in rows:
        held_out, ladder = (float(cell.rstrip("%")) for cell in row[4:6])
        assert held_out <= ladder
    assert lines[-1].startswith("largest held-out waste above the ladder's at the same N: ")
    assert lines[-1].endswith("(goal <= 0.00%)")
