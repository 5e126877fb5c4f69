"""The tools under `tools/` run (no timing asserts: timings belong in docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    # The tools import graphcap; make the checkout importable even without `pip install -e .`.
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def test_bench_stage_runs():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_stage.py"), "--quick"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    for column in ("graphcap med", "p90", "python med", "speedup"):
        assert column in header
    rows = [line for line in lines if line.startswith(("decode", "prefill"))]
    assert [row.split("  ")[0] for row in rows] == [
        "decode 1 reqs",
        "decode 64 reqs",
        "decode 256 reqs",
        "decode 1024 reqs",
        "prefill 8 reqs, 2048 tok",
    ]
