"""`tools/reliability.py --quick` runs the whole campaign small and writes its table (no timings checked)."""

from __future__ import annotations

import re

from tests.tools import run_tool


def test_quick_campaign_writes_a_complete_table(tmp_path):
    out = tmp_path / "docs" / "RELIABILITY.md"
    result = run_tool("reliability.py", "--quick", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert text.startswith("# Reliability")
    for line in ("- date: ", "- machine: ", "- command: `python tools/reliability.py --quick`"):
        assert line in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| area")]
    areas = {row.split(" | ")[0].strip("| ") for row in rows}
    assert areas == {
        "configs",
        "steps",
        "faults",
        "stale data",
        "threads",
        "moved inputs",
        "verification",
        "command line",
        "outputs",
        "engine buffers",
        "lifecycle",
        "lazy capture",
        "scratch blocks",
        "sampled steps",
    }
    for row in rows:
        passed, total = map(int, re.search(r": (\d+)/(\d+)", row).groups())
        assert passed == total > 0, row
    assert "## Failures" not in text
    assert "| area | what was tried | count | outcome |" in result.stdout  # the table on stdout too
