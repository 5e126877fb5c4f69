"""`tools/bench_recorder.py` runs (`--quick`) and prints the recorder's rows and its cost beside the goal."""

from __future__ import annotations

import re

from tests.tools import run_tool


def test_bench_recorder_prints_on_off_and_the_copy_beside_its_goal():
    result = run_tool("bench_recorder.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    names = [
        line.split("  ")[0].strip() for line in result.stdout.splitlines() if line.startswith(("stage", "record", "on"))
    ]
    assert names == ["stage, recorder on", "stage, recorder off", "record alone", "on - off"]
    assert (
        "decode of 256 requests (64 block-table columns), 4 steps in the ring, slot copy 70668 bytes" in result.stdout
    )
    assert re.search(r"goal: on - off <= about 1 us per step: -?[\d.]+ us", result.stdout)
