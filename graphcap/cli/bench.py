"""`graphcap bench`: eager vs replay per captured key; optional plot of time, memory, speedup."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from graphcap.cli._common import UserError, add_common, build_manager

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
    from graphcap.report import format_bytes
    from graphcap.testing.timing import time_key

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


def plot_capture(report, timings, path: str | os.PathLike) -> Path:
    """Three panels over token count: capture ms, graph memory, replay speedup (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    speedups = {t.key: t.speedup for t in timings}
    for uniform, marker, label in ((True, "o", "uniform decode"), (False, "s", "mixed")):
        rows = sorted((r for r in report.captured if r.key.uniform == uniform), key=lambda r: r.key.num_tokens)
        if not rows:
            continue
        tokens = [r.key.num_tokens for r in rows]
        axes[0].plot(tokens, [r.capture_seconds * 1e3 for r in rows], marker=marker, label=label)
        axes[1].plot(tokens, [r.memory_bytes / 2**20 for r in rows], marker=marker, label=label)
        with_speed = [r for r in rows if r.key in speedups]
        axes[2].plot(
            [r.key.num_tokens for r in with_speed], [speedups[r.key] for r in with_speed], marker=marker, label=label
        )
    axes[2].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    # Log scale: the first graph of a process also pays one-time setup (imports, lazy
    # init) and would flatten every other point on a linear axis.
    axes[0].set_yscale("log")
    titles = ("capture time per graph (ms, log)", "graph memory (MiB)", "replay speedup over eager (x)")
    for axis, title in zip(axes, titles):
        axis.set_title(title)
        axis.set_xlabel("padded tokens per step")
        axis.grid(alpha=0.3)
        axis.legend()
    note = ""
    if report.backend == "emulated":
        note = " (CPU emulation: replay runs the same kernels as eager, so ~1x is expected)"
    fig.suptitle(f"graphcap: {len(report.captured)} graphs, {report.backend} backend on {report.device}{note}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
