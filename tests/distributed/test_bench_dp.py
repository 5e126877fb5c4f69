"""`tools/bench_dp.py --quick` runs end to end (two gloo ranks) and prints its table; no timing asserts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dp_quick_prints_every_row():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_dp.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for row in ("KeyRegistry.dispatch (no group)", "dist.all_reduce", "DataParallelSync.agree", "dispatch + agree"):
        assert row in done.stdout, done.stdout
    assert "agreed mixed(tokens=40, reqs=32)" in done.stdout
