"""Start-up time of the `graphcap` command: `--help`, `--version`, `validate`, `sizes`.

Each command runs as a fresh `python -m graphcap` process, `--runs` times; median and
p10-p90 in milliseconds. `--base DIR` runs the same commands against another checkout's
`graphcap/` (e.g. `git archive <commit> | tar -x -C DIR`) for a before/after table.

    python tools/bench_startup.py [--runs 15] [--base /tmp/base]
    python tools/bench_startup.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "graphcap" / "configs" / "tiny-cpu-ci.yaml")
COMMANDS = {
    "--help": ["--help"],
    "--version": ["--version"],
    "validate": ["validate", CONFIG],
    "sizes": ["sizes", "--config", CONFIG],
}


def time_command(root: Path, argv: list[str], runs: int) -> tuple[float, float, float]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "graphcap", *argv], capture_output=True, env=env, cwd=root, check=True)
        samples.append((time.perf_counter() - start) * 1e3)
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[len(ordered) // 10], ordered[-1 - len(ordered) // 10]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="processes per command (default 15)")
    parser.add_argument("--base", type=Path, help="another checkout to compare with")
    parser.add_argument("--quick", action="store_true", help="2 runs of each command")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    roots = [("this checkout", REPO)] + ([("base", args.base)] if args.base else [])
    print(f"{'command':<10} {'tree':<14} {'median ms':>9} {'p10-p90 ms':>13}")
    for name, argv in COMMANDS.items():
        for label, root in roots:
            median, p10, p90 = time_command(root, argv, runs)
            print(f"{name:<10} {label:<14} {median:>9.0f} {f'{p10:.0f}-{p90:.0f}':>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
