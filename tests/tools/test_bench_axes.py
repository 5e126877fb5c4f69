"""`tools/bench_axes.py` prints a row per traffic shape and seed: sizes x lora values within the graphs, the waste
held out no worse than the ladder's at as many sizes, and axis values chosen that pad no more slots."""

from __future__ import annotations

from graphcap.testing.traffic import TRAFFIC_SHAPES
from tests.tools import run_tool


def test_bench_axes_prints_a_row_per_shape_within_the_graphs_and_the_goal():
    result = run_tool("bench_axes.py", "--seeds", "1", "--max-graphs", "22", "--lora", "0,2,4,8", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in TRAFFIC_SHAPES]
    assert [row[0] for row in rows] == list(TRAFFIC_SHAPES)
    for row in rows:
        assert (row[2], row[3]) == ("5", "20")  # 22 graphs // 4 lora values
        held_out, ladder = (float(cell.rstrip("%")) for cell in row[5:7])
        assert held_out <= ladder
        slots, chosen = (float(cell.rstrip("%")) for cell in row[8:10])
        assert chosen <= slots
    assert lines[-1].startswith("largest held-out token waste above the ladder's at as many sizes: ")
    assert lines[-1].endswith("(goal <= 0.00%)")
