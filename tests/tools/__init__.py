"""Tests of the scripts under `tools/` (no timing asserts: timings belong in docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"


def run_tool(name: str, *args: str, cwd: Path = REPO, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run `tools/NAME` with this interpreter; the checkout is importable even without `pip install -e .`."""
    path = os.environ.get("PYTHONPATH")
    environ = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""), **env}
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environ,
        timeout=timeout,
    )
