"""Start-up time of the `graphcap` command against a bare interpreter, side by side.

Each command runs as a fresh `python -m graphcap` process, and a bare `python -c pass` runs
beside it, interleaved run by run in this one process so that both see the same load; the
table gives medians, the p10-p90 range in milliseconds and each command's ratio to the bare
interpreter (goal for `--help`: at most 2x). `--base DIR` runs the same commands against
another checkout's `graphcap/` (e.g. `git archive <commit> | tar -x -C DIR`) for a
before/after table, interleaved too.

Each tree's `graphcap/` is byte-compiled first and the children may use the bytecode, as an
installed package does (pip compiles it): with `PYTHONDONTWRITEBYTECODE=1` every run would
compile each graphcap module from source again, a cost no installed copy pays.

    python tools/bench_startup.py [--runs 15] [--base /tmp/base]
    python tools/bench_startup.py --quick
"""

from __future__ import annotations

import argparse
import compileall
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
BARE = "python -c pass"


def _run_ms(argv: list[str], root: Path) -> float:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, env=env, cwd=root, check=True)
    return (time.perf_counter() - start) * 1e3


def measure(roots: list[tuple[str, Path]], runs: int) -> dict[tuple[str, str], list[float]]:
    """Samples (ms) per (command, tree), the bare interpreter included; one round runs everything once."""
    samples: dict[tuple[str, str], list[float]] = {}
    for _, root in roots:
        compileall.compile_dir(root / "graphcap", quiet=1)
    for _ in range(runs):
        samples.setdefault((BARE, ""), []).append(_run_ms([sys.executable, "-c", "pass"], REPO))
        for name, argv in COMMANDS.items():
            for label, root in roots:
                ms = _run_ms([sys.executable, "-m", "graphcap", *argv], root)
                samples.setdefault((name, label), []).append(ms)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="processes per command (default 15)")
    parser.add_argument("--base", type=Path, help="another checkout to compare with")
    parser.add_argument("--quick", action="store_true", help="2 runs of each command")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    roots = [("this checkout", REPO)] + ([("base", args.base)] if args.base else [])
    samples = measure(roots, runs)
    bare = statistics.median(samples[(BARE, "")])
    print(f"{'command':<16} {'tree':<14} {'median ms':>9} {'p10-p90 ms':>13} {'x bare':>7}")
    for (name, label), values in samples.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        p10, p90 = ordered[len(ordered) // 10], ordered[-1 - len(ordered) // 10]
        print(f"{name:<16} {label:<14} {median:>9.0f} {f'{p10:.0f}-{p90:.0f}':>13} {median / bare:>6.1f}x")
    helps = [statistics.median(v) for (name, label), v in samples.items() if "--help" in name and label == roots[0][0]]
    if helps:
        print(f"goal: graphcap --help <= {HELP_GOAL:g}x a bare interpreter: {helps[0] / bare:.1f}x")
    return 0


HELP_GOAL = 2.0


if __name__ == "__main__":
    sys.exit(main())
