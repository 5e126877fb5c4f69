"""`graphcap sizes`: the capture schedule, the padding table, the keys, the expected waste."""

from __future__ import annotations

import argparse
import math
import os

from graphcap.cli._common import UserError, add_common, config_from_args
from graphcap.sizes import CaptureSizes, default_capture_sizes

EPILOG = """examples:
  graphcap sizes                                   # the embedded default config
  graphcap sizes --config spec-decode
  graphcap sizes --max-size 512 --uniform-query-len 4
  graphcap sizes --config my.yaml --histogram batch_sizes.txt

A histogram file holds one observed token count per line, or `TOKENS COUNT` pairs
(whitespace or comma separated); `#` starts a comment.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sizes",
        help="show the capture schedule, padding table and padded-token waste",
        description="Show the capture sizes of a config (or of --max-size), the padding table, the graph keys, "
        "and the expected fraction of padded tokens.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(parser, device=False)
    parser.add_argument("--max-size", type=int, metavar="N", help="show default_capture_sizes(N) instead of a config's")
    parser.add_argument(
        "--uniform-query-len", type=int, default=1, metavar="Q", help="with --max-size: tokens per uniform request"
    )
    parser.add_argument("--histogram", metavar="FILE", help="observed batch token counts, for the expected waste")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from graphcap.dispatch import MIXED_ROWS_FLOOR, MIXED_ROWS_STEP, KeyRegistry  # numpy: loaded when run
    from graphcap.memory import estimate_memory

    if args.max_size is not None:
        if args.config or args.overrides:
            raise UserError("give either --max-size or --config/--set, not both")
        _check_schedule_flags(args.max_size, args.uniform_query_len)
        sizes = CaptureSizes(default_capture_sizes(args.max_size, args.uniform_query_len), args.max_size)
        registry = None
        source = f"default_capture_sizes({args.max_size}, uniform_query_len={args.uniform_query_len})"
    else:
        config = config_from_args(args)
        sizes = config.capture_sizes
        registry = KeyRegistry.from_config(config)
        source = f"{args.config or 'embedded default config'} (capture.mode {config.capture.mode})"
    histogram = _read_histogram(args.histogram) if args.histogram else None
    print(f"capture sizes from {source}")
    print(f"  {len(sizes)} sizes: {', '.join(map(str, sizes.sizes))}")
    print()
    print(f"  {'tokens':>13}  {'pads to':>7}  {'waste at worst':>14}")
    for first, last, padded in sizes.padding_table():
        span = f"{first}" if first == last else f"{first}-{last}"
        print(f"  {span:>13}  {padded:>7}  {(padded - first) / padded:>13.1%}")
    print(f"  {'>' + str(sizes.max_size):>13}  {'eager':>7}")
    if registry is not None:
        uniform = [k for k in registry.planned if k.uniform]
        mixed = [k for k in registry.planned if not k.uniform and not k.piecewise]
        pieces = [k for k in registry.planned if k.piecewise]
        counts = f"{len(uniform)} uniform, {len(mixed)} mixed" + (f", {len(pieces)} piecewise" if pieces else "")
        print()
        print(f"  graph keys: {len(registry.planned)} ({counts})")
        if pieces:
            print(f"    piecewise (tokens, any request count): {' '.join(str(k.num_tokens) for k in pieces)}")
        if uniform:
            print(f"    uniform (tokens/reqs): {' '.join(f'{k.num_tokens}/{k.num_reqs}' for k in uniform)}")
        if mixed:
            rows: dict[int, list[int]] = {}
            for k in mixed:
                rows.setdefault(k.num_tokens, []).append(k.num_reqs)
            listing = " ".join(f"{size}/{','.join(map(str, sorted(r)))}" for size, r in rows.items())
            print(f"    mixed   (tokens/reqs): {listing}")
            if any(len(r) > 1 for r in rows.values()):
                print(
                    "    a mixed step pads its requests to the fewest rows of its size that hold them "
                    f"(every {MIXED_ROWS_STEP}x fewer down to {MIXED_ROWS_FLOOR}), not always to "
                    "min(size, max_num_seqs)"
                )
        print()
        backend = _backend_of(config.device)
        print(f"  {estimate_memory(config, backend=backend).describe()}")
    print()
    what = (
        f"over the histogram in {args.histogram}"
        if histogram
        else f"with token counts 1..{sizes.max_size} equally likely"
    )
    print(f"  expected padded-token waste {what}: {sizes.expected_waste(histogram):.1%}")
    if histogram:
        above = sum(w for n, w in histogram.items() if n > sizes.max_size)
        total = sum(histogram.values())
        print(f"  steps above the max size (eager): {above / total:.1%}")
    return 0


def _backend_of(device: str) -> str:
    """The backend a config's device uses; for `auto`, the one it picks here, told apart without
    importing torch by whether an NVIDIA driver is loaded (`--set device=cpu` or `cuda` to choose)."""
    if device == "auto":
        return "cuda" if os.path.exists("/proc/driver/nvidia/version") else "emulated"
    return "cuda" if device.startswith("cuda") else "emulated"


def _check_schedule_flags(max_size: int, uniform_query_len: int) -> None:
    """The flags obey the config's own bounds (`capture.max_size` <= 65536: the padding table has
    one entry per token count, so 10**8 would run for minutes and 10**9 exhaust memory)."""
    from graphcap.config import CaptureSectionConfig, ConfigError

    try:
        CaptureSectionConfig(max_size=max_size, uniform_query_len=uniform_query_len)
    except ConfigError as exc:
        flags = {"capture.max_size": "--max-size", "capture.uniform_query_len": "--uniform-query-len"}
        raise UserError("; ".join(f"{flags.get(p.key, p.key)}: {p.message}" for p in exc.problems)) from None


MAX_HISTOGRAM_BYTES = 64 << 20
"""Largest histogram read (64 MiB: ten million one-per-line observations)."""
_MAX_LINE = 4096


def _read_histogram(path: str) -> dict[int, float]:
    """`TOKENS [COUNT]` lines -> {tokens: weight}; every problem is a `UserError` naming file and line."""
    counts: dict[int, float] = {}
    try:
        with open(path, "rb") as handle:
            read = 0
            for number, raw in enumerate(iter(lambda: handle.readline(_MAX_LINE + 1), b""), 1):
                read += len(raw)
                if len(raw) > _MAX_LINE:
                    raise UserError(f"{path}:{number}: line longer than {_MAX_LINE} bytes; is it a histogram?")
                if read > MAX_HISTOGRAM_BYTES:
                    raise UserError(
                        f"{path}: larger than {MAX_HISTOGRAM_BYTES >> 20} MiB; aggregate it as TOKENS COUNT"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                        "expected TOKENS or TOKENS COUNT"
                    ) from None
                _add_line(counts, line, path, number)
    except OSError as exc:
        raise UserError(f"--histogram {path}: cannot read: {exc.strerror or exc}") from None
    total = sum(counts.values())
    if not counts or total <= 0:
        raise UserError(f"{path}: no batch sizes in the histogram")
    if not math.isfinite(total):
        raise UserError(f"{path}: the counts sum to {total}; scale them down (they are relative weights)")
    return counts


def _add_line(counts: dict[int, float], line: str, path: str, number: int) -> None:
    text = line.split("#", 1)[0].replace(",", " ").split()
    if not text:
        return
    try:
        values = [float(v) for v in text]
    except ValueError:
        raise UserError(f"{path}:{number}: expected TOKENS or TOKENS COUNT; got {line.strip()!r}") from None
    if (
        len(values) > 2
        or not all(map(math.isfinite, values))  # int(inf) and int(nan) raise
        or values[0] != int(values[0])
        or values[0] < 1
        or (len(values) == 2 and values[1] < 0)
    ):
        raise UserError(
            f"{path}:{number}: expected a token count >= 1 and an optional count >= 0; got {line.strip()!r}"
        )
    counts[int(values[0])] = counts.get(int(values[0]), 0.0) + (values[1] if len(values) == 2 else 1.0)
