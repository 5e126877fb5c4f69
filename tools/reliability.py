"""Reliability campaign: bad configs, fuzzed steps, capture faults, poisoned stress, threads, the command line.

Runs everything the reliability suite (`tests/reliability/`) checks, many more times, and
writes docs/RELIABILITY.md: date, machine, command, and one table row per experiment with
its count and outcome ("refused with ConfigError naming the key: 412/412"). Exits 1 when
any outcome is short of its count (the failures are listed in the document).

    python tools/reliability.py                       # full campaign, writes docs/RELIABILITY.md
    python tools/reliability.py --quick --out /tmp/R.md   # smoke test (seconds)

The checks an engine can run on its own model (the fault-injecting model, hostile steps and
their oracle, the poisoned stress loop, the threaded runs) live in `graphcap.testing`; the
campaign's own cases and experiments, one room per area, in `tools/campaign/`, which the tests
import too, so the campaign and the suite cannot drift apart. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from campaign.capture_faults import fault_rows
from campaign.checks import checks_rows
from campaign.command_line import cli_rows
from campaign.configs import config_rows, dp_config_rows
from campaign.lifecycle import lifecycle_rows
from campaign.moved_inputs import moved_rows
from campaign.record import render
from campaign.steps import shape_rows, step_rows
from campaign.streams import stress_rows, thread_rows
from campaign.trials import FULL, QUICK, Row, log

from graphcap.report_files import atomic_write

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python tools/reliability.py --quick --out /tmp/RELIABILITY.md",
    )
    parser.add_argument("--quick", action="store_true", help="a few of each, to see that it runs")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "RELIABILITY.md", help="where to write the table")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random configs and steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("graphcap").setLevel(logging.ERROR)  # skipped keys are expected here
    scale = QUICK if args.quick else FULL
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="graphcap-reliability-") as workdir:
        sections: list[tuple[str, Callable[[], list[Row]]]] = [
            ("configs", lambda: config_rows(scale, rng)),
            ("data-parallel configs", lambda: dp_config_rows(scale, Path(workdir))),
            ("steps", lambda: step_rows(scale, rng)),
            ("faults", lambda: fault_rows(scale, Path(workdir))),
            ("stale data", lambda: stress_rows(scale)),
            ("threads", lambda: thread_rows(scale)),
            ("moved inputs", lambda: moved_rows(scale)),
            ("command line", lambda: cli_rows(scale, Path(workdir))),
            ("outputs and engine buffers", lambda: shape_rows(scale, rng)),
            ("lifecycle", lambda: lifecycle_rows(scale)),
            ("checks", lambda: checks_rows(scale)),
        ]
        for name, run in sections:
            t0 = time.perf_counter()
            rows += run()
            log(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    flags = " --quick" if args.quick else ""
    flags += f" --seed {args.seed}" if args.seed else ""
    command = f"python tools/reliability.py{flags}"
    text = render(rows, command, time.perf_counter() - start)
    atomic_write(args.out, text)
    print(text[text.index("| area") : text.index("\n## How")])
    log(f"wrote {args.out}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
