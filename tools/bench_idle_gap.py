"""`capture_pending(max_seconds)` in an engine's idle gap, with an engine-sized Python heap.

Builds a heap of `--objects` GC-tracked objects (default 3M: an engine with transformers imported
holds that many) in this process, then on the built-in model (the embedded default config on the CPU
unless `--config`):

1. a lazy manager is called with `capture_pending(--gap)` until nothing is pending: keys and seconds
   per call, against the goals (at least one key per call, every key within keys + 2 calls);
2. a call with nothing pending, timed `--calls` times, interleaved with full `gc.collect()`s of the
   heap (the goal: under 2% of one), and beside them the GC work an upfront pass does around itself
   (`gc_frozen`: one full collection before, the young generations after);
3. an upfront `capture()` pass, beside its full collection before the pass.

    python tools/bench_idle_gap.py [--objects N] [--gap S] [--calls N] [--config PATH] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from graphcap import CaptureManager, load_config
from graphcap.capture.gc_hold import gc_frozen
from graphcap.models import build_model

NOTHING_PENDING_GOAL = 0.02
"""A call with nothing pending costs under 2% of one full collection of the heap."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=3_000_000, help="GC-tracked objects in the heap")
    parser.add_argument("--gap", type=float, default=0.1, help="max_seconds of each capture_pending call")
    parser.add_argument("--calls", type=int, default=21, help="timed calls with nothing pending (and collections)")
    parser.add_argument("--config", help="YAML config (default: the embedded default on the CPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="300k objects, sizes up to 8, 5 calls (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    objects = 300_000 if args.quick else args.objects
    calls = 5 if args.quick else args.calls
    overrides = {} if args.config else {"device": "cpu"}
    if args.quick:
        overrides["capture.max_size"] = 8
    heap = [[] for _ in range(objects)]  # lists: each one tracked by GC, as an engine's objects are
    tracked = len(gc.get_objects())
    print(f"heap: {objects:,} GC-tracked objects ({tracked:,} in all); {torch.get_num_threads()} thread(s)")

    config = load_config(args.config, {**overrides, "capture.strategy": "lazy"})
    manager = CaptureManager(build_model(config), config, progress=False)
    manager.capture()
    num_keys = len(manager.pending())
    per_call, first_key = [], []
    capture_keys = manager.capturer.capture_keys

    def noted(job, keys, progress):  # when the call's first key starts
        first_key.append(time.perf_counter())
        return capture_keys(job, keys, progress)

    manager.capturer.capture_keys = noted
    while manager.pending() and len(per_call) < num_keys + 2:
        first_key.clear()
        began = time.perf_counter()
        keys = manager.capture_pending(max_seconds=args.gap)
        seconds = time.perf_counter() - began
        per_call.append((keys, seconds, (first_key[0] - began) * 1e3 if first_key else None))
    manager.capturer.capture_keys = capture_keys
    print()
    print(f"capture_pending(max_seconds={args.gap}) until nothing is pending ({num_keys} keys)")
    print(f"{'call':>4} {'keys':>4} {'seconds':>8} {'ms before the first key':>24}")
    for index, (keys, seconds, before) in enumerate(per_call, 1):
        print(f"{index:>4} {keys:>4} {seconds:>8.3f} {'-' if before is None else f'{before:.3f}':>24}")
    fewest = min(keys for keys, _, _ in per_call)
    left = len(manager.pending())
    print(f"fewest keys in a call: {fewest} (goal >= 1)")
    print(f"calls to capture every key: {len(per_call)}{' (keys left!)' if left else ''} (goal <= {num_keys + 2})")

    nothing, full, frozen = [], [], []
    for _ in range(calls):  # interleaved: each round times all three
        began = time.perf_counter()
        manager.capture_pending(max_seconds=args.gap)
        nothing.append(time.perf_counter() - began)
        began = time.perf_counter()
        gc.collect()
        full.append(time.perf_counter() - began)
        began = time.perf_counter()
        with gc_frozen():
            pass
        frozen.append(time.perf_counter() - began)
    ratios = [n / f for n, f in zip(nothing, full)]
    print()
    print(f"a call with nothing pending vs one full gc.collect() of the heap ({calls} rounds, interleaved)")
    print(f"{'what':<40} {'median ms':>10} {'min-max ms':>17}")
    for what, values in (
        ("capture_pending(), nothing pending", nothing),
        ("gc.collect() (full)", full),
        ("gc_frozen() around nothing (upfront)", frozen),
    ):
        low, high = min(values) * 1e3, max(values) * 1e3
        print(f"{what:<40} {statistics.median(values) * 1e3:>10.4f} {low:>8.4f}-{high:<8.4f}")
    print(
        f"nothing pending / full collection per round: median {statistics.median(ratios):.5%} "
        f"(max {max(ratios):.5%}; goal < {NOTHING_PENDING_GOAL:.0%})"
    )

    upfront = load_config(args.config, overrides)
    passes, collections = [], []
    for _ in range(2 if args.quick else 3):
        manager = CaptureManager(build_model(upfront), upfront, progress=False)
        began = time.perf_counter()
        gc.collect()
        collections.append(time.perf_counter() - began)
        passes.append(manager.capture().total_seconds)
        manager.release()
    print()
    print("an upfront capture() pass and the one full collection it starts with")
    collection, a_pass = statistics.median(collections), statistics.median(passes)
    print(
        f"pass median {a_pass:.2f} s ({min(passes):.2f}-{max(passes):.2f}); full collection "
        f"median {collection:.3f} s: {collection / a_pass:.1%} of a pass"
    )
    del heap
    return 0


if __name__ == "__main__":
    sys.exit(main())
