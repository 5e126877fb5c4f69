"""`graphcap bench`: eager vs replay per captured key, with spread; optional plot and report."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from graphcap.cli._common import (
    CommandFailed,
    UserError,
    add_common,
    add_report,
    check_at_least,
    config_from_args,
    report_target,
    stage,
    write_report,
)
from graphcap.cli.capture import check_something_captured, command_line

EPILOG = """examples:
  graphcap bench --steps 50
  graphcap bench --config llama3-8b-h200 --plot bench.png --report bench.json

Each key runs --steps timed steps per side through the real step path (staging, invariants,
then the model eagerly or the graph replay) on a batch that fills it, eager and replay
interleaved, timed with torch.utils.benchmark.Timer, with torch pinned to --threads CPU
threads (default 1: two threads on two busy cores made one run of the default config take 8
minutes instead of 45 s). A bar on stderr shows the key being timed (--no-progress: none).
The table gives the median and the 10th-90th percentile range; '!' marks a noisy key
(interquartile range above 10% of the median): rerun it on a quiet machine or with more
--steps before trusting its speedup.
In the modes piecewise and full_and_piecewise each piecewise key gets its own row (kind
piecewise, timed on a mixed batch of its size): at one size it compares eager, piecewise and,
where the mode captures one, full graphs. The plot's format follows the suffix of --plot
(png, pdf, svg, ...).
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
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch CPU threads while capturing and timing (default 1: more threads than free cores make every "
        "timing noisy on a shared machine)",
    )
    parser.add_argument(
        "--plot", metavar="FILE", help="draw capture time, memory and speedup per size (needs matplotlib)"
    )
    add_report(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from graphcap.cli._setup import build_manager
    from graphcap.config.byte_counts import format_bytes
    from graphcap.workload import fill_batch

    check_at_least(steps=(args.steps, 1), threads=(args.threads, 1))
    if args.plot:
        _check_plot_path(args.plot)
    config = config_from_args(args, report__path=args.report)
    report_path = report_target(args, config)
    manager = build_manager(args, dataclasses.replace(config, report=dataclasses.replace(config.report, path=None)))
    with _torch_threads(args.threads):
        stage("capturing")
        report = manager.capture()
        check_something_captured(report)
        stage("timing")
        timed = _time_keys(manager, [r.key for r in report.captured], args.steps, progress=not args.no_progress)
    timings = [t for t in timed.values() if t is not None]
    by_key = {r.key: r for r in report.records}
    print(
        f"{'key':<9} {'tokens':>6} {'reqs':>5} {'capture ms':>10} {'memory':>10} "
        f"{'eager ms':>9} {'p10-p90':>15} {'replay ms':>9} {'p10-p90':>15} {'speedup':>7}"
    )
    for t in timings:
        r = by_key[t.key]
        kind = _kind(t.key)
        reqs = fill_batch(t.key, config).num_reqs if t.key.piecewise else t.key.num_reqs
        print(
            f"{kind:<9} {t.key.num_tokens:>6} {reqs:>5} {r.capture_seconds * 1e3:>10.1f} "
            f"{format_bytes(r.memory_bytes):>10} {t.eager.median:>9.3f} {_range(t.eager):>15} "
            f"{t.replay.median:>9.3f} {_range(t.replay):>15} {t.speedup:>6.2f}x{' !' if t.noisy else ''}".rstrip()
        )
    noisy = [t for t in timings if t.noisy]
    if noisy:
        print(
            f"! noisy ({len(noisy)} of {len(timings)} keys): interquartile range above 10% of the median; "
            "rerun on a quiet machine or with more --steps before trusting these speedups"
        )
    untimed = [str(k) for k, t in timed.items() if t is None]
    if untimed:
        print(f"not timed (no real batch dispatches to them): {', '.join(untimed)}")
    print()
    print(report.summary())
    latency = {t.key: t.to_dict() for t in timings}
    report.records = [dataclasses.replace(r, latency=latency.get(r.key)) for r in report.records]
    report.config = config.to_dict()
    report.command = command_line(args)
    if args.plot:
        _write_plot(report, timings, args.plot)
    if report_path:
        write_report(report, report_path)
    return 0


@contextlib.contextmanager
def _torch_threads(num: int) -> Iterator[None]:
    """torch's CPU thread count pinned to `num` for the duration (the caller's is put back)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _time_keys(manager, keys: list, steps: int, *, progress: bool) -> dict:
    """`time_key` for every key, with a progress bar on stderr (a terminal only; none with --no-progress)."""
    from tqdm import tqdm

    from graphcap.capture.timing import time_key

    timed = {}
    with tqdm(keys, desc="timing", unit="key", disable=None if progress else True, leave=False) as bar:
        for key in bar:
            bar.set_postfix_str(str(key), refresh=False)
            timed[key] = time_key(manager, key, steps=steps)
    return timed


def _kind(key) -> str:
    return "piecewise" if key.piecewise else "uniform" if key.uniform else "mixed"


def _range(spread) -> str:
    return f"{spread.p10:.3f}-{spread.p90:.3f}"


def _check_plot_path(path: str) -> None:
    """Refuse, before any capture, a plot that matplotlib cannot write in the format its suffix names."""
    from pathlib import Path

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'graphcap[plot]'") from None
    formats = Figure().canvas.get_supported_filetypes()
    target = Path(path)
    suffix = target.suffix.lower().lstrip(".")
    if target.is_dir():
        raise UserError(f"--plot {path}: is a directory; give a file name such as {Path(path) / 'bench.png'}")
    if suffix not in formats:
        named = f"unknown image format {suffix!r}" if suffix else "no suffix to name the image format"
        raise UserError(f"--plot {path}: {named}; use one of {', '.join(sorted(formats))} (e.g. bench.png)")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--plot {path}: cannot be created: {parent} is not a directory")


def _write_plot(report, timings, path: str) -> None:
    from pathlib import Path

    from graphcap.report_files import atomic_write

    data = plot_capture(report, timings, Path(path).suffix.lower().lstrip("."))
    try:
        atomic_write(Path(path), data)
    except OSError as exc:
        raise CommandFailed(f"cannot write the plot to {path}: {exc.strerror or exc}") from exc
    print(f"plot written to {path}")


def plot_capture(report, timings, image_format: str = "png") -> bytes:
    """Three panels over token count: capture ms, memory per graph, replay speedup; the image's bytes.

    Speedups are medians with the p10-p90 range as error bars, on a log axis so that one
    outlier cannot flatten the rest; noisy keys are drawn hollow.
    """
    import io

    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    by_key = {t.key: t for t in timings}
    for kind, marker, label in (
        ("uniform", "o", "uniform decode"),
        ("mixed", "s", "mixed"),
        ("piecewise", "^", "piecewise"),
    ):
        rows = sorted((r for r in report.captured if _kind(r.key) == kind), key=lambda r: r.key.num_tokens)
        if not rows:
            continue
        tokens = [r.key.num_tokens for r in rows]
        axes[0].plot(tokens, [r.capture_seconds * 1e3 for r in rows], marker=marker, label=label)
        axes[1].plot(tokens, [r.memory_bytes / 2**20 for r in rows], marker=marker, label=label)
        timed = [by_key[r.key] for r in rows if r.key in by_key]
        if not timed:
            continue
        x = [t.key.num_tokens for t in timed]
        y = [t.speedup for t in timed]
        low = [t.speedup - t.speedup_range[0] for t in timed]
        high = [t.speedup_range[1] - t.speedup for t in timed]
        line = axes[2].errorbar(x, y, yerr=[low, high], marker=marker, capsize=3, label=label)
        noisy = [t for t in timed if t.noisy]
        if noisy:
            color = line.lines[0].get_color()
            axes[2].scatter(
                [t.key.num_tokens for t in noisy],
                [t.speedup for t in noisy],
                marker=marker,
                s=80,
                facecolors="white",
                edgecolors=color,
                zorder=3,
                label=f"{label}: noisy",
            )
    axes[2].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    # Log scales: the first graph of a process also pays one-time setup, and a speedup of 0.1x
    # and one of 10x are the same distance from 1x.
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    titles = (
        "capture time per graph (ms, log)",
        "memory per graph (MiB)",
        "replay speedup over eager (x, log; bars p10-p90)",
    )
    for axis, title in zip(axes, titles):
        axis.set_title(title)
        axis.set_xlabel("padded tokens per step")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    note = ""
    if report.backend == "emulated":
        note = " (CPU emulation: replay runs the same kernels as eager, so ~1x is expected)"
    fig.suptitle(f"graphcap: {len(report.captured)} graphs, {report.backend} backend on {report.device}{note}")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=image_format, dpi=110)
    return buffer.getvalue()
