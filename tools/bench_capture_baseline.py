"""A capture pass of this tree beside the same pass of another git revision, in one process.

Both versions (this checkout's `graphcap` and REV's, imported as `graphcap_base` by `_baseline.py`)
build the same model from the same config and capture once (the process's own lazy set-up); then
each round re-captures on both, the order alternating every round, and the table gives each
version's whole-pass seconds (median, min-max) and the per-round ratio this tree / REV. A re-capture
pass runs every step of a first one (preflight, warmups, recording, verification) on a warm
process, so the ratio is the orchestration's, not the interpreter's start-up.

    python tools/bench_capture_baseline.py REV [--config PATH] [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from _baseline import load

import graphcap


def build(pkg, path: str | None, quick: bool):
    """A captured manager of package `pkg`, built from `path` (the embedded default on the CPU without it)."""
    overrides = {} if path else {"device": "cpu"}
    if quick:
        overrides["capture.max_size"] = 8
    config = pkg.load_config(path, overrides)
    model = importlib.import_module(f"{pkg.__name__}.models").build_model(config)
    manager = pkg.CaptureManager(model, config, progress=False)
    manager.capture()
    return manager


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the git revision to compare with")
    parser.add_argument("--config", help="YAML config (default: the embedded default on the CPU)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (each: one pass per version)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 8, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    rounds = 2 if args.quick else args.rounds
    torch.set_num_threads(1)
    managers = {"this tree": build(graphcap, args.config, args.quick)}
    managers[args.rev] = build(load(args.rev), args.config, args.quick)
    seconds: dict[str, list[float]] = {name: [] for name in managers}
    order = list(managers)
    for index in range(rounds):
        for name in order if index % 2 == 0 else order[::-1]:
            began = time.perf_counter()
            managers[name].capture()
            seconds[name].append(time.perf_counter() - began)
    keys = len(managers["this tree"].graphs)
    print(f"re-capture pass, {keys} keys, 1 torch thread, {rounds} rounds alternating")
    print(f"{'version':<16} {'median s':>9} {'min-max s':>15}")
    for name, values in seconds.items():
        print(f"{name:<16} {statistics.median(values):>9.3f} {min(values):>7.3f}-{max(values):<7.3f}")
    ratios = sorted(a / b for a, b in zip(seconds["this tree"], seconds[args.rev]))
    print(
        f"this tree / {args.rev}: median {statistics.median(ratios):.2f}x "
        f"(min-max {ratios[0]:.2f}-{ratios[-1]:.2f}x; under 1: faster here)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
