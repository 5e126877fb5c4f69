"""`tools/bench_capture.py --padding` prints the waste of chosen sizes against vLLM's ladder."""

from __future__ import annotations

from graphcap.testing.traffic import TRAFFIC_SHAPES
from tests.tools import run_tool


def test_bench_capture_padding_prints_a_row_per_shape_and_the_worst_waste():
    result = run_tool("bench_capture.py", "--padding", "--seeds", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("shape"))
    for column in ("ladder 51", "chosen 30", "chosen 51", "graphs = ladder", "graphs <= 5%"):
        assert column in header
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in TRAFFIC_SHAPES]
    assert [row[0] for row in rows] == list(TRAFFIC_SHAPES)
    for row in rows:
        ladder, chosen_30, chosen_51 = (float(cell.rstrip("%")) for cell in row[4:7])
        assert chosen_30 <= 5.0 and chosen_51 <= ladder
        assert int(row[8]) <= 30  # graphs for at most 5% waste
    assert [line.split()[:2] for line in lines if line.startswith("synthetic 1")] == [
        ["synthetic", "1"],
        ["synthetic", "1/n"],
    ]
    assert lines[-1].startswith("worst waste with 30 chosen graphs (60% of the ladder's 51) on the traffic shapes: ")
