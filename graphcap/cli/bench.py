"""`graphcap bench`: eager vs replay per captured key; optional plot of time, memory, speedup."""

from __future__ import annotations

import argparse

from graphcap.cli._common import UserError, add_common, build_manager
from graphcap.report import format_bytes, plot_capture
from graphcap.testing.timing import time_key

EPILOG = """examples:
  graphcap bench --steps 50
  graphcap bench --config capture_configs/llama3-8b-h200.yaml --plot bench.png

Times are medians per step through the real step path (staging, invariants, then the
model eagerly or the graph replay), for a batch that fills each key exactly.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="time eager vs graph replay for every captured key",
        description="Capture a config's graphs, then time eager steps and graph replays per key.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(parser)
    parser.add_argument("--steps", type=int, default=20, metavar="N", help="timed steps per key and side (default 20)")
    parser.add_argument(
        "--plot", metavar="PNG", help="draw capture time, memory and speedup per size (needs matplotlib)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1; got {args.steps}")
    if args.plot:
        _require_matplotlib()
    manager = build_manager(args)
    report = manager.capture()
    timed = {r.key: time_key(manager, r.key, steps=args.steps) for r in report.captured}
    timings = [t for t in timed.values() if t is not None]
    by_key = {r.key: r for r in report.records}
    print(
        f"{'key':<8} {'tokens':>6} {'reqs':>5} {'capture ms':>10} {'memory':>10} "
        f"{'eager ms':>9} {'replay ms':>9} {'speedup':>7}"
    )
    for t in timings:
        r = by_key[t.key]
        kind = "uniform" if t.key.uniform else "mixed"
        print(
            f"{kind:<8} {t.key.num_tokens:>6} {t.key.num_reqs:>5} {r.capture_seconds * 1e3:>10.1f} "
            f"{format_bytes(r.memory_bytes):>10} {t.eager_ms:>9.3f} {t.replay_ms:>9.3f} {t.speedup:>6.2f}x"
        )
    untimed = [str(k) for k, t in timed.items() if t is None]
    if untimed:
        print(f"not timed (no real batch dispatches to them): {', '.join(untimed)}")
    print()
    print(report.summary())
    if args.plot:
        plot_capture(report, timings, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'graphcap[plot]'") from None
