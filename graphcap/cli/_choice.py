"""`graphcap sizes --max-graphs`/`--memory-budget`: sizes chosen for a histogram, printed (`sizes: [...]`, the
table, the waste per key-axis value, the eager steps) and written (`--out`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

from graphcap.cli._common import UserError
from graphcap.cli._histogram import read_steps
from graphcap.sizing.sizes import CaptureSizes

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig
    from graphcap.sizing.choice import GraphCosts

__all__ = ["backend_of", "choose"]


def backend_of(device: str) -> str:
    """The backend a config's device uses; for `auto`, the one it picks here, told apart without
    importing torch by whether an NVIDIA driver is loaded (`--set device=cpu` or `cuda` to choose)."""
    if device == "auto":
        return "cuda" if os.path.exists("/proc/driver/nvidia/version") else "emulated"
    return "cuda" if device.startswith("cuda") else "emulated"


def choose(
    args: argparse.Namespace, config: CaptureConfig | None, current: CaptureSizes, max_graphs: int, budget: int | None
) -> int:
    """`--max-graphs`/`--memory-budget`: `sizes: [...]`, the table, the comparison, `--out`."""
    from graphcap.report_files import atomic_write
    from graphcap.sizing.axes import AxisPlan, axis_values_held_out, choose_axis_values, choose_with_axes, slot_waste
    from graphcap.sizing.choice import SizeConstraints, candidate_sizes
    from graphcap.sizing.held_out import ladder_sizes

    if config is None:
        if budget is not None:
            raise UserError(
                "--memory-budget needs a config's model for its memory estimate: use --config, not --max-size"
            )
        constraints = SizeConstraints(args.max_size, args.uniform_query_len)
        limit = f"--max-size {args.max_size}"
        plan = AxisPlan()
    else:
        try:
            constraints = SizeConstraints.from_config(config)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        limit = f"capture.max_size {config.capture.max_size}"
        if (
            config.capture.max_size is not None and constraints.max_size < config.capture.max_size
        ):  # full_decode_only: the largest uniform key
            q = config.capture.uniform_query_len
            limit = f"batching.max_num_seqs {config.batching.max_num_seqs} x uniform_query_len {q}"
        plan = AxisPlan.from_config(config)
    if args.choose_axes and (not plan.values or plan.num_combinations != math.prod(map(len, plan.values.values()))):
        why = "lists combinations by value (drop the list)" if plan.values else "plans no key axis"
        raise UserError(f"--choose-axes chooses the values of capture.axes, and the config {why}")
    if not args.choose_axes:  # chosen axis values plan no more combinations: checked once they are chosen
        _check_combinations(max_graphs, plan)
    created = None
    if args.out is not None:
        created = _check_out(args.out, (args.config, args.histogram))
    steps = read_steps(args.histogram, plan)
    axes_chosen = None
    if args.choose_axes and config is not None:  # a config plans the axes (checked above)
        try:
            values = choose_axis_values(steps, plan)
        except ValueError as exc:
            raise UserError(f"--choose-axes: {exc}") from None
        axes_chosen = (
            plan,
            slot_waste(steps, plan.values),
            slot_waste(steps, values),
            axis_values_held_out(steps, plan),
        )
        config = dataclasses.replace(config, capture=dataclasses.replace(config.capture, axes=values))
        plan = AxisPlan(values)
        _check_combinations(max_graphs, plan)
    largest = max((n for (n, _), w in steps.items() if w > 0), default=0)
    if config is not None and largest > config.batching.max_num_tokens:
        raise UserError(
            f"--histogram {args.histogram}: token count {largest} is above batching.max_num_tokens "
            f"{config.batching.max_num_tokens}, which no step of this config exceeds; is the histogram from "
            "another engine config? (raise batching.max_num_tokens to match it)"
        )
    replayed: dict[int, float] = {}
    for (n, axes), w in steps.items():
        if plan.place(axes)[0] is not None:
            replayed[n] = replayed.get(n, 0.0) + w
    candidates = candidate_sizes(replayed, constraints) if any(replayed.values()) else ()
    if not candidates:
        smallest = min((n for n, w in replayed.items() if w > 0), default=None)
        if smallest is None:
            raise UserError(
                f"--histogram {args.histogram}: no observed step can replay: every step's axis values are above "
                f"the largest of capture.axes ({_axes(plan)}) or held by no combination; add those values to "
                "capture.axes (or capture.axis_combinations)"
            )
        raise UserError(
            f"--histogram {args.histogram}: no observed step can replay: the smallest token count {smallest} is "
            f"above {limit}, so no size can be chosen; raise that limit or give a histogram of this config's traffic"
        )
    costs: GraphCosts | None = None
    each: list[GraphCosts] = []
    try:
        if config is not None and (config.model.factory is None or budget is not None):  # a budget needs one
            priced = tuple(sorted({*candidates, *ladder_sizes(constraints)}))
            costs, each = _costs(config, priced)
        chosen = choose_with_axes(steps, max_graphs, constraints, plan, costs=costs, memory_budget=budget)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.out is not None:
        try:
            atomic_write(args.out, _fragment(chosen, args))
        except OSError as exc:
            raise UserError(f"--out {args.out}: cannot write: {exc.strerror or exc}") from None
    _print(args, chosen, current, limit, max_graphs, budget, each, config is not None, axes_chosen)
    if args.out is not None:
        made = f" (created {created})" if created else ""
        keys = (
            "capture.sizes, capture.max_size and capture.axes" if axes_chosen else "capture.sizes and capture.max_size"
        )
        print(f"  wrote {keys} to {args.out}{made}")
    return 0


def _check_combinations(max_graphs: int, plan: Any) -> None:
    combos = plan.num_combinations
    if max_graphs < combos:
        raise UserError(
            f"--max-graphs {max_graphs} is below the {combos} combinations of key axes ({_axes(plan)}): every "
            f"size is captured at each combination, so --max-graphs counts sizes x {combos}; give --max-graphs "
            f"{combos} or more (a multiple of {combos} uses every graph), or plan fewer combinations "
            "(capture.axis_combinations)"
        )


def _print(
    args: argparse.Namespace,
    chosen: Any,
    current: CaptureSizes,
    limit: str,
    max_graphs: int,
    budget: int | None,
    each: list[Any],
    has_config: bool,
    axes_chosen: tuple | None,
) -> None:
    from graphcap.config.byte_counts import format_bytes

    held, choice, plan, steps = chosen.held, chosen.held.choice, chosen.plan, chosen.steps
    total = sum(steps.values())
    graphs = f"{len(choice.sizes)} graphs"
    if plan.values:
        graphs = f"{chosen.num_graphs} graphs: {_sizes(choice.sizes)} x {plan.num_combinations} combinations"
    print(f"sizes: [{', '.join(map(str, choice.sizes))}]" + (f"  # {graphs}" if plan.values else ""))
    if axes_chosen:
        config_axes = _yaml_axes(axes_chosen[0].values)
        print(f"axes: {_yaml_axes(plan.values)}  # chosen from the histogram; the config's: {config_axes}")
    limits = ", ".join(
        ([f"at most {max_graphs} graphs"] if args.max_graphs is not None else [])
        + ([f"memory budget {format_bytes(budget)}"] if budget is not None else [])
    )
    print(f"chosen for {_count(total)} steps in {args.histogram} ({limits}; {limit})")
    print()
    print(f"  {'size':>6}  {'tokens':>11}  {'steps':>6}  {'pad/step':>8}  {'waste':>6}")
    for size, first, at_size, real, padded in choice.buckets():
        span = f"{first}" if first == size else f"{first}-{size}"
        pad = (padded - real) / at_size if at_size else 0.0
        waste = (padded - real) / padded if padded else 0.0
        print(f"  {size:>6}  {span:>11}  {at_size / total:>6.1%}  {pad:>8.2f}  {waste:>6.1%}")
    print()
    print(f"  expected padded-token waste: {choice.waste:.1%} with {graphs} (in sample)")
    if held.held_out is None:
        print("  held-out waste: not scored (the histogram's counts are not whole steps, or a half replays none)")
    else:
        scores = ", ".join(f"{way} {waste:.1%}" for way, waste in held.held_out.items())
        print(
            f"  held-out waste: {held.held_out[held.way]:.1%} (chosen on half the steps, scored on the other, both "
            f"ways; {scores}: sizes chosen by {held.way})"
        )
    if plan.values:
        _print_values(chosen)
    if axes_chosen:
        config_plan, config_waste, waste, held_out = axes_chosen
        for name in plan.values:
            scored = "not scored" if held_out is None else f"{held_out[name]:.1%} held out"
            print(
                f"  {name} values chosen from the histogram: padded slots {waste[name]:.1%} in sample, {scored} "
                f"(values chosen on half the steps, scored on the other, both ways); the config's "
                f"{list(config_plan.values[name])}: {config_waste[name]:.1%}"
            )
    was = "the config's" if has_config else "the default schedule's"
    before = axes_chosen[0] if axes_chosen else plan  # the config's own axis values
    replayed: dict[int, float] = {}
    for (n, axes), w in steps.items():
        if before.place(axes)[0] is not None:
            replayed[n] = replayed.get(n, 0.0) + w
    above = sum(w for (n, axes), w in steps.items() if n > current.max_size or before.place(axes)[0] is None) / total
    was += f" {len(current)} sizes" + (f" ({len(current) * before.num_combinations} graphs)" if plan.values else "")
    print(f"  {was}: {current.expected_waste(replayed):.1%} (eager {above:.1%} of steps)")
    reasons = chosen.eager_reasons()
    if reasons:
        parts = []
        for reason, at in reasons.items():
            if reason == "above_max_size":  # within the limit: steps whose axis values kept them out of the choice
                q, top = choice.constraints.multiple_of, choice.constraints.largest
                within = sorted(step for step in at if -(-step[0] // q) * q <= top)
                if within:
                    why = f"above the largest size {choice.sizes[-1]} (their key-axis values replay no graph)"
                    parts.append(f"{_what(reason, within)}: {why}")
                at = {step: w for step, w in at.items() if step not in within}
                if not at:
                    continue
            parts.append(f"{_what(reason, sorted(at))}: {_why(reason, limit, plan)}")
        print(f"  steps that run eagerly: {chosen.eager_share:.1%} ({'; '.join(parts)})")
    else:
        print("  steps that run eagerly: none (the largest size holds the largest observed step)")
    if each:
        shown = ", ".join(f"{c.backend} {format_bytes(c.bytes_of(choice.sizes))}" for c in each)
        print(f"  graph memory estimate: {shown}" + (f" (budget {format_bytes(budget)})" if budget else ""))


def _print_values(chosen: Any) -> None:
    """The waste per planned key-axis value: in sample, and held out where the steps split."""
    held_out = chosen.held_out_values
    print("  per key-axis value: steps replayed at it, their padded tokens and padded axis slots")
    head = f"    {'axis':<10} {'value':>6}  {'steps':>6}  {'tokens':>6}  {'slots':>6}"
    print(head + (f"  | held out: {'steps':>6}  {'tokens':>6}  {'slots':>6}" if held_out else ""))
    for i, row in enumerate(chosen.values()):
        line = f"    {row.axis:<10} {row.value:>6}  {row.share:>6.1%}  {_pct(row.token_waste)}  {_pct(row.slot_waste)}"
        if held_out:
            other = held_out[i]
            line += f"  |           {other.share:>6.1%}  {_pct(other.token_waste)}  {_pct(other.slot_waste)}"
        print(line)


def _sizes(sizes: tuple[int, ...]) -> str:
    return "1 size" if len(sizes) == 1 else f"{len(sizes)} sizes"


def _yaml_axes(values: Any) -> str:
    return "{" + ", ".join(f"{name}: [{', '.join(map(str, v))}]" for name, v in values.items()) + "}"


def _pct(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:>6.1%}"


def _what(reason: str, steps: list[tuple[int, tuple[tuple[str, int], ...]]]) -> str:
    """The eager steps of a reason as a reader takes them in: their token counts, or axis values."""
    if reason.startswith("above_max_axis."):
        name = reason.partition(".")[2]
        values = sorted({dict(axes)[name] for _, axes in steps})
        return f"{name}={values[0]}" if len(values) == 1 else f"{name}={values[0]}-{values[-1]}"
    if reason == "no_axis_combination":
        combos = sorted({axes for _, axes in steps})
        shown = ", ".join(" ".join(f"{n}={v}" for n, v in axes) for axes in combos[:3])
        return shown + (f" and {len(combos) - 3} more" if len(combos) > 3 else "")
    return _span(sorted({n for n, _ in steps}))


def _why(reason: str, limit: str, plan: Any) -> str:
    if reason.startswith("above_max_axis."):
        name = reason.partition(".")[2]
        return f"above capture.axes.{name}'s largest value {plan.values[name][-1]} ({reason})"
    why = {
        "above_max_size": f"above {limit}",
        "over_budget": "over the memory budget",
        "decode_only": "not whole uniform requests, under full_decode_only",
        "no_axis_combination": "no combination of capture.axis_combinations holds them (no_axis_combination)",
    }
    return why[reason]


def _axes(plan: Any) -> str:
    return "; ".join(f"capture.axes.{name} {list(values)}" for name, values in plan.values.items()) or "none"


def _costs(config: CaptureConfig, sizes: tuple[int, ...]) -> tuple[GraphCosts, list[GraphCosts]]:
    """`GraphCosts` for the backends the config's device may use, and with two (device `auto`) the
    larger of each part, so a choice within a budget fits on either."""
    from graphcap.memory.graph_costs import graph_costs
    from graphcap.sizing.choice import GraphCosts

    each = [graph_costs(config, sizes, backend_of(config.device))]
    if len(each) == 1:
        return each[0], each
    per_size = {s: max(c.per_size[s] for c in each) for s in sizes}
    shared = {s: max(c.shared[s] for c in each) for s in sizes}
    return GraphCosts(per_size, shared, " or ".join(c.backend for c in each)), each


def _fragment(chosen: Any, args: argparse.Namespace) -> str:
    """YAML that sets the chosen schedule; `capture.max_size` follows it (load_config requires equal)."""
    choice = chosen.held.choice
    flags = [("--config", args.config), ("--histogram", args.histogram), ("--max-graphs", args.max_graphs)]
    flags.append(("--memory-budget", args.memory_budget))
    command = " ".join(f"{flag} {value}" for flag, value in flags if value is not None)
    graphs = ""
    if chosen.plan.values:
        graphs = (
            f"; {chosen.num_graphs} graphs ({len(choice.sizes)} sizes x {chosen.plan.num_combinations} combinations)"
        )
    axes = ""
    if args.choose_axes:
        command += " --choose-axes"
        axes = "  axes:\n" + "".join(
            f"    {name}: [{', '.join(map(str, v))}]\n" for name, v in chosen.plan.values.items()
        )
    return (
        f"# graphcap sizes {command}\n"
        f"# expected padded-token waste {choice.waste:.1%}{graphs}; merge into the config's capture section\n"
        "capture:\n"
        f"  sizes: [{', '.join(map(str, choice.sizes))}]\n"
        f"  max_size: {choice.sizes[-1]}\n"
        f"{axes}"
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
