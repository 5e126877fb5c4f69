"""`graphcap sizes`: the capture schedule, the padding table, the keys, the expected waste; with
`--max-graphs` (or `--memory-budget`), the sizes chosen for a traffic histogram (`graphcap.cli._choice`)."""

from __future__ import annotations

import argparse

from graphcap.cli._common import UserError, add_common, config_from_args
from graphcap.cli._histogram import read_steps
from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes

EPILOG = """examples:
  graphcap sizes                                   # the embedded default config
  graphcap sizes --config spec-decode
  graphcap sizes --max-size 512 --uniform-query-len 4
  graphcap sizes --config my.yaml --histogram batch_sizes.txt
  graphcap sizes --config my.yaml --histogram batch_sizes.txt --max-graphs 30 --out sizes.yaml
  graphcap sizes --config my.yaml --histogram batch_sizes.txt --max-graphs 30 --memory-budget 4GiB
  graphcap sizes --config lora.yaml --histogram steps.txt --max-graphs 50 --choose-axes

A histogram file holds one observed token count per line, or `TOKENS COUNT` pairs
(whitespace or comma separated), each optionally followed by the step's key-axis values,
`AXIS=VALUE` (e.g. `12 40 lora=3`; an axis not given is at its smallest value); `#` starts
a comment.

--max-graphs N chooses the sizes (within capture.max_size) that pad the fewest tokens over the
histogram, counting a graph per size and combination of capture.axes (without axes: N sizes):
the first line is `sizes: [...]`, then a table and, with key axes, the waste per axis value.
--memory-budget keeps the graphs (every combination's) within graphcap's memory estimate.
--choose-axes chooses each axis's values from the histogram too. --out writes a config fragment
(capture.sizes and capture.max_size, and capture.axes with --choose-axes) to merge into the config,
creating missing directories as capture --report does (checked before any work: a path under a
file or in a directory without write permission is refused).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sizes",
        help="show the capture schedule, padding table and padded-token waste, or choose sizes for traffic",
        description="Show the capture sizes of a config (or of --max-size), the padding table, the graph keys, "
        "and the expected fraction of padded tokens; with --max-graphs, choose the sizes for a histogram.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(parser, device=False)
    parser.add_argument("--max-size", type=int, metavar="N", help="show default_capture_sizes(N) instead of a config's")
    parser.add_argument(
        "--uniform-query-len", type=int, default=1, metavar="Q", help="with --max-size: tokens per uniform request"
    )
    parser.add_argument(
        "--histogram", metavar="FILE", help="observed batch token counts (and key-axis values), for the expected waste"
    )
    parser.add_argument(
        "--max-graphs",
        metavar="N",
        help="choose sizes for the --histogram traffic: at most N graphs (sizes x axis combinations)",
    )
    parser.add_argument(
        "--memory-budget", metavar="BYTES", help="choose sizes whose graphs fit, e.g. 4GiB (graphcap's estimate)"
    )
    parser.add_argument("--out", metavar="FILE", help="write the chosen sizes as a config fragment (YAML)")
    parser.add_argument(
        "--choose-axes",
        action="store_true",
        help="choose each key axis's values from the histogram too (at most the config's count, within its largest)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from graphcap.cli._choice import backend_of, choose
    from graphcap.keys import MIXED_ROWS_FLOOR, MIXED_ROWS_STEP, KeyRegistry  # numpy: loaded when run
    from graphcap.memory.estimate import estimate_memory
    from graphcap.sizing.axes import AxisPlan

    choosing = args.max_graphs is not None or args.memory_budget is not None
    if not choosing and args.out is not None:
        raise UserError("--out writes chosen sizes: give --max-graphs N (and --histogram FILE) with it")
    if not choosing and args.choose_axes:
        raise UserError("--choose-axes chooses axis values with the sizes: give --max-graphs N and --histogram FILE")
    if choosing:
        max_graphs = _parse_max_graphs(args.max_graphs)
        budget = None if args.memory_budget is None else parse_bytes(args.memory_budget, "--memory-budget")
        if args.histogram is None:
            raise UserError("--max-graphs and --memory-budget choose sizes for traffic: give --histogram FILE")
    config = None
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
    if choosing:
        return choose(args, config, sizes, max_graphs, budget)
    plan = AxisPlan() if config is None else AxisPlan.from_config(config)
    steps = read_steps(args.histogram, plan) if args.histogram else None
    histogram: dict[int, float] | None = None  # the token counts of the steps whose axis values replay
    off_axes = 0.0  # the other steps
    if steps is not None:
        histogram = {}
        for (n, axes), w in steps.items():
            if plan.place(axes)[0] is None:
                off_axes += w
            else:
                histogram[n] = histogram.get(n, 0.0) + w
    print(f"capture sizes from {source}")
    print(f"  {len(sizes)} sizes: {', '.join(map(str, sizes.sizes))}")
    print()
    print(f"  {'tokens':>13}  {'pads to':>7}  {'waste at worst':>14}")
    for first, last, padded in sizes.padding_table():
        span = f"{first}" if first == last else f"{first}-{last}"
        print(f"  {span:>13}  {padded:>7}  {(padded - first) / padded:>13.1%}")
    print(f"  {'>' + str(sizes.max_size):>13}  {'eager':>7}")
    if registry is not None and config is not None:  # both come from a config
        tokens = list(dict.fromkeys(k.base for k in registry.planned))  # each token key once, whatever its axes
        uniform = [k for k in tokens if k.uniform]
        mixed = [k for k in tokens if not k.uniform and not k.piecewise]
        pieces = [k for k in tokens if k.piecewise]
        counts = f"{len(uniform)} uniform, {len(mixed)} mixed" + (f", {len(pieces)} piecewise" if pieces else "")
        print()
        if registry.axes:
            combos = len(registry.planned) // max(1, len(tokens))
            listed = "; ".join(f"{name} {', '.join(map(str, values))}" for name, values in registry.axes.items())
            print(f"  graph keys: {len(registry.planned)} ({len(tokens)} token keys ({counts}) x {combos} combinations")
            print(f"    of key axes: {listed})")
        else:
            print(f"  graph keys: {len(registry.planned)} ({counts})")
        if pieces:
            print(f"    piecewise (tokens, any request count): {' '.join(str(k.num_tokens) for k in pieces)}")
        if uniform:
            print(f"    uniform (tokens/reqs): {' '.join(f'{k.num_tokens}/{k.num_reqs}' for k in uniform)}")
        if mixed:
            rows: dict[int, list[int]] = {}
            for k in mixed:
                if k.num_reqs is not None:  # a mixed key's rows
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
        backend = backend_of(config.device)
        print(f"  {estimate_memory(config, backend=backend).describe()}")
    print()
    what = (
        f"over the histogram in {args.histogram}" if steps else f"with token counts 1..{sizes.max_size} equally likely"
    )
    print(f"  expected padded-token waste {what}: {sizes.expected_waste(histogram):.1%}")
    if steps:
        above = sum(w for (n, _), w in steps.items() if n > sizes.max_size)
        total = sum(steps.values())
        print(f"  steps above the max size (eager): {above / total:.1%}")
        if plan.values:
            print(f"  steps whose key-axis values no planned combination holds (eager): {off_axes / total:.1%}")
    return 0


def _check_schedule_flags(max_size: int, uniform_query_len: int) -> None:
    """The flags obey the config's own bounds (`capture.max_size` <= 65536: the padding table has
    one entry per token count, so 10**8 would run for minutes and 10**9 exhaust memory)."""
    from graphcap.config import CaptureSectionConfig, ConfigError

    try:
        CaptureSectionConfig(max_size=max_size, uniform_query_len=uniform_query_len)
    except ConfigError as exc:
        flags = {"capture.max_size": "--max-size", "capture.uniform_query_len": "--uniform-query-len"}
        raise UserError("; ".join(f"{flags.get(p.key, p.key)}: {p.message}" for p in exc.problems)) from None


def _parse_max_graphs(text: str | None) -> int:
    if text is None:
        return 1 << 16  # only a budget: as many sizes as it allows
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise UserError(f"--max-graphs: expected a whole number >= 1; got {text!r}")
    return value


def parse_bytes(text: str, flag: str) -> int:
    """`graphcap.config.byte_counts.parse_bytes`, with `UserError` naming `flag`."""
    from graphcap.config import byte_counts  # when a size is parsed: `graphcap --help` loads no more than it needs

    try:
        return byte_counts.parse_bytes(text)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None
