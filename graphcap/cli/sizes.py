"""`graphcap sizes`: the capture schedule, the padding table, the keys, the expected waste; with
`--max-graphs` (or `--memory-budget`), the sizes chosen for a traffic histogram (`graphcap.sizing.choice`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from graphcap.cli._common import UserError, add_common, config_from_args
from graphcap.cli._histogram import read_histogram
from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes

EPILOG = """examples:
  graphcap sizes                                   # the embedded default config
  graphcap sizes --config spec-decode
  graphcap sizes --max-size 512 --uniform-query-len 4
  graphcap sizes --config my.yaml --histogram batch_sizes.txt
  graphcap sizes --config my.yaml --histogram batch_sizes.txt --max-graphs 30 --out sizes.yaml
  graphcap sizes --config my.yaml --histogram batch_sizes.txt --max-graphs 30 --memory-budget 4GiB

A histogram file holds one observed token count per line, or `TOKENS COUNT` pairs
(whitespace or comma separated); `#` starts a comment.

--max-graphs N chooses at most N sizes (within capture.max_size) that pad the fewest tokens
over the histogram: the first line is `sizes: [...]`, then a table. --memory-budget keeps the
graphs within graphcap's memory estimate. --out writes a config fragment (capture.sizes and
capture.max_size) to merge into the config, creating missing directories as capture --report does
(checked before any work: a path under a file or in a directory without write permission is refused).
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
    parser.add_argument("--histogram", metavar="FILE", help="observed batch token counts, for the expected waste")
    parser.add_argument("--max-graphs", metavar="N", help="choose at most N sizes for the --histogram traffic")
    parser.add_argument(
        "--memory-budget", metavar="BYTES", help="choose sizes whose graphs fit, e.g. 4GiB (graphcap's estimate)"
    )
    parser.add_argument("--out", metavar="FILE", help="write the chosen sizes as a config fragment (YAML)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from graphcap.keys import MIXED_ROWS_FLOOR, MIXED_ROWS_STEP, KeyRegistry  # numpy: loaded when run
    from graphcap.memory.estimate import estimate_memory

    choosing = args.max_graphs is not None or args.memory_budget is not None
    if not choosing and args.out is not None:
        raise UserError("--out writes chosen sizes: give --max-graphs N (and --histogram FILE) with it")
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
        return _choose(args, config, sizes, max_graphs, budget)
    histogram = read_histogram(args.histogram) if args.histogram else None
    print(f"capture sizes from {source}")
    print(f"  {len(sizes)} sizes: {', '.join(map(str, sizes.sizes))}")
    print()
    print(f"  {'tokens':>13}  {'pads to':>7}  {'waste at worst':>14}")
    for first, last, padded in sizes.padding_table():
        span = f"{first}" if first == last else f"{first}-{last}"
        print(f"  {span:>13}  {padded:>7}  {(padded - first) / padded:>13.1%}")
    print(f"  {'>' + str(sizes.max_size):>13}  {'eager':>7}")
    if registry is not None:
        tokens = list(dict.fromkeys(k.base for k in registry.planned))  # each token key once, whatever its axes
        uniform = [k for k in tokens if k.uniform]
        mixed = [k for k in tokens if not k.uniform and not k.piecewise]
        pieces = [k for k in tokens if k.piecewise]
        counts = f"{len(uniform)} uniform, {len(mixed)} mixed" + (f", {len(pieces)} piecewise" if pieces else "")
        print()
        if registry.axes:
            combos = len(registry.planned) // max(1, len(tokens))
            axes = "; ".join(f"{name} {', '.join(map(str, values))}" for name, values in registry.axes.items())
            print(f"  graph keys: {len(registry.planned)} ({len(tokens)} token keys ({counts}) x {combos} combinations")
            print(f"    of key axes: {axes})")
        else:
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


def _choose(args: argparse.Namespace, config: Any, current: CaptureSizes, max_graphs: int, budget: int | None) -> int:
    """`--max-graphs`/`--memory-budget`: `sizes: [...]`, the table, the comparison, `--out`."""
    from graphcap.config.byte_counts import format_bytes
    from graphcap.report_files import atomic_write
    from graphcap.sizing.choice import SizeConstraints, candidate_sizes
    from graphcap.sizing.held_out import choose_held_out, ladder_sizes

    if config is None:
        if budget is not None:
            raise UserError(
                "--memory-budget needs a config's model for its memory estimate: use --config, not --max-size"
            )
        constraints = SizeConstraints(args.max_size, args.uniform_query_len)
        limit = f"--max-size {args.max_size}"
    else:
        try:
            constraints = SizeConstraints.from_config(config)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        limit = f"capture.max_size {config.capture.max_size}"
        if constraints.max_size < config.capture.max_size:  # full_decode_only: the largest uniform key
            q = config.capture.uniform_query_len
            limit = f"batching.max_num_seqs {config.batching.max_num_seqs} x uniform_query_len {q}"
    created = None
    if args.out is not None:
        created = _check_out(args.out, (args.config, args.histogram))
    histogram = read_histogram(args.histogram)
    largest = max((n for n, steps in histogram.items() if steps > 0), default=0)
    if config is not None and largest > config.batching.max_num_tokens:
        raise UserError(
            f"--histogram {args.histogram}: token count {largest} is above batching.max_num_tokens "
            f"{config.batching.max_num_tokens}, which no step of this config exceeds; is the histogram from "
            "another engine config? (raise batching.max_num_tokens to match it)"
        )
    candidates = candidate_sizes(histogram, constraints)
    if not candidates:
        smallest = min(n for n, steps in histogram.items() if steps > 0)
        raise UserError(
            f"--histogram {args.histogram}: no observed step can replay: the smallest token count {smallest} is "
            f"above {limit}, so no size can be chosen; raise that limit or give a histogram of this config's traffic"
        )
    costs, each = None, []
    try:
        if (config is not None and config.model.factory is None) or budget is not None:
            priced = tuple(sorted({*candidates, *ladder_sizes(constraints)}))
            costs, each = _costs(config, priced)
        held = choose_held_out(histogram, max_graphs, constraints, costs=costs, memory_budget=budget)
        choice = held.choice
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.out is not None:
        try:
            atomic_write(args.out, _fragment(choice, args))
        except OSError as exc:
            raise UserError(f"--out {args.out}: cannot write: {exc.strerror or exc}") from None
    total = sum(histogram.values())
    print(f"sizes: [{', '.join(map(str, choice.sizes))}]")
    limits = ", ".join(
        ([f"at most {max_graphs} graphs"] if args.max_graphs is not None else [])
        + ([f"memory budget {format_bytes(budget)}"] if budget is not None else [])
    )
    print(f"chosen for {_count(total)} steps in {args.histogram} ({limits}; {limit})")
    print()
    print(f"  {'size':>6}  {'tokens':>11}  {'steps':>6}  {'pad/step':>8}  {'waste':>6}")
    for size, first, steps, real, padded in choice.buckets():
        span = f"{first}" if first == size else f"{first}-{size}"
        pad = (padded - real) / steps if steps else 0.0
        waste = (padded - real) / padded if padded else 0.0
        print(f"  {size:>6}  {span:>11}  {steps / total:>6.1%}  {pad:>8.2f}  {waste:>6.1%}")
    print()
    print(f"  expected padded-token waste: {choice.waste:.1%} with {len(choice.sizes)} graphs (in sample)")
    if held.held_out is None:
        print("  held-out waste: not scored (the histogram's counts are not whole steps, or a half replays none)")
    else:
        scores = ", ".join(f"{way} {waste:.1%}" for way, waste in held.held_out.items())
        print(
            f"  held-out waste: {held.held_out[held.way]:.1%} (chosen on half the steps, scored on the other, both "
            f"ways; {scores}: sizes chosen by {held.way})"
        )
    was = "the config's" if config is not None else "the default schedule's"
    above = sum(w for n, w in histogram.items() if n > current.max_size) / total
    print(f"  {was} {len(current)} sizes: {current.expected_waste(histogram):.1%} (eager {above:.1%} of steps)")
    if choice.eager:
        why = {
            "above_max_size": f"above {limit}",
            "over_budget": "over the memory budget",
            "decode_only": "not whole uniform requests, under full_decode_only",
        }
        parts = [f"{_span(sorted(counts))}: {why[reason]}" for reason, counts in choice.eager_reasons().items()]
        print(f"  steps that run eagerly: {choice.eager_share:.1%} ({'; '.join(parts)})")
    else:
        print("  steps that run eagerly: none (the largest size holds the largest observed step)")
    if each:
        shown = ", ".join(f"{c.backend} {format_bytes(c.bytes_of(choice.sizes))}" for c in each)
        print(f"  graph memory estimate: {shown}" + (f" (budget {format_bytes(budget)})" if budget else ""))
    if args.out is not None:
        made = f" (created {created})" if created else ""
        print(f"  wrote capture.sizes and capture.max_size to {args.out}{made}")
    return 0


def _costs(config: Any, sizes: tuple[int, ...]) -> tuple[Any, list[Any]]:
    """`GraphCosts` for the backends the config's device may use, and with two (device `auto`) the
    larger of each part, so a choice within a budget fits on either."""
    from graphcap.memory.graph_costs import graph_costs
    from graphcap.sizing.choice import GraphCosts

    each = [graph_costs(config, sizes, _backend_of(config.device))]
    if len(each) == 1:
        return each[0], each
    per_size = {s: max(c.per_size[s] for c in each) for s in sizes}
    shared = {s: max(c.shared[s] for c in each) for s in sizes}
    return GraphCosts(per_size, shared, " or ".join(c.backend for c in each)), each


def _fragment(choice: Any, args: argparse.Namespace) -> str:
    """YAML that sets the chosen schedule; `capture.max_size` follows it (load_config requires equal)."""
    flags = [("--config", args.config), ("--histogram", args.histogram), ("--max-graphs", args.max_graphs)]
    flags.append(("--memory-budget", args.memory_budget))
    command = " ".join(f"{flag} {value}" for flag, value in flags if value is not None)
    return (
        f"# graphcap sizes {command}\n"
        f"# expected padded-token waste {choice.waste:.1%}; merge into the config's capture section\n"
        "capture:\n"
        f"  sizes: [{', '.join(map(str, choice.sizes))}]\n"
        f"  max_size: {choice.sizes[-1]}\n"
    )


def _check_out(path: str, inputs: tuple[str | None, ...]) -> str | None:
    """Refuse an `--out` that is a directory, one of the command's own input files, or a path whose
    missing directories cannot be created (`capture --report`'s rules); the first directory to create."""
    if os.path.isdir(path):
        raise UserError(f"--out {path}: is a directory; give a file name, e.g. {os.path.join(path, 'sizes.yaml')}")
    for given in inputs:
        if given and os.path.exists(path) and os.path.exists(given) and os.path.samefile(path, given):
            raise UserError(f"--out {path}: is the input file {given}; writing there would destroy it")
    parent, missing = os.path.dirname(os.path.abspath(path)), None
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:  # the directories the write creates
        parent, missing = os.path.dirname(parent), parent
    if not os.path.isdir(parent):
        raise UserError(f"--out {path}: cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {path}: cannot be written: no write permission in {parent}")
    return missing


def _span(counts: list[int]) -> str:
    if len(counts) == 1:
        return f"token count {counts[0]}"
    return f"token counts {counts[0]}-{counts[-1]}"


def _count(total: float) -> str:
    """A step count as a reader takes it in: whole counts up to 10**12 in full, others in 4 digits (`1.235e+300`)."""
    if total == int(total) and total < 1e12:
        return f"{int(total)}"
    return f"{total:.4g}"


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
