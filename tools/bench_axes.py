"""Sizes chosen for traffic with a key axis: graphs counted per combination, padded tokens and padded slots.

Per traffic shape of `graphcap.testing.traffic` and seed, the steps of `adapter_steps` (each request a LoRA
adapter of 16, or none; a step's `lora` value is the distinct adapters it runs) are given to
`graphcap.sizing.axes.choose_with_axes` with `capture.axes.lora` at the values of `--lora` (default
0, 2, 4, 8, 16: 5 combinations) and `--max-graphs` graphs (default 50: 10 sizes). Printed per row: the sizes and
graphs chosen, the padded-token waste in sample and held out (chosen on half the steps, scored on the other,
both ways) beside the default ladder's held out at as many sizes, the steps that run eagerly for an axis value
above the largest, and the padded LoRA slots of the configured values and of values chosen from the traffic
(`choose_axis_values`, what `graphcap sizes --choose-axes` does), in sample and held out. No timing: the
numbers are exact for the steps.

    python tools/bench_axes.py [--seeds N] [--max-graphs N] [--lora 0,2,4,8,16]
"""

from __future__ import annotations

import argparse
import sys

from graphcap.sizing.axes import AxisPlan, axis_values_held_out, choose_axis_values, choose_with_axes, slot_waste
from graphcap.sizing.choice import SizeConstraints
from graphcap.testing.traffic import TRAFFIC_SHAPES, adapter_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per traffic shape")
    parser.add_argument("--max-graphs", type=int, default=50, help="graphs: sizes x lora values")
    parser.add_argument("--lora", default="0,2,4,8,16", help="the planned lora values, ascending")
    args = parser.parse_args()
    values = tuple(int(v) for v in args.lora.split(","))
    plan, bound = AxisPlan({"lora": values}), SizeConstraints(512)
    print(f"sizes chosen for LoRA traffic: at most {args.max_graphs} graphs, lora values {list(values)}")
    print("token waste: padded tokens over replayed ones; slots: padded lora slots over the graphs' slots")
    header = (
        f"{'shape':<14} {'seed':>4} {'sizes':>5} {'graphs':>6} {'in sample':>9} {'held out':>8} {'ladder':>7}"
        f" {'eager axis':>10} {'slots':>6} {'chosen slots':>12} {'held out':>8}  chosen values"
    )
    print(header)
    worst = 0.0
    for shape in TRAFFIC_SHAPES:
        for seed in range(args.seeds):
            steps = adapter_steps(shape, seed)
            chosen = choose_with_axes(steps, args.max_graphs, bound, plan)
            held = chosen.held.held_out
            ours, ladder = held[chosen.held.way], held["ladder"]
            worst = max(worst, ours - ladder)
            reasons = chosen.eager_reasons()
            total = sum(steps.values())
            axis_eager = sum(sum(r.values()) for k, r in reasons.items() if k.startswith("above_max_axis")) / total
            picked = choose_axis_values(steps, plan)
            slots, picked_slots = slot_waste(steps, plan.values)["lora"], slot_waste(steps, picked)["lora"]
            picked_held = axis_values_held_out(steps, plan)["lora"]
            row = (
                f"{shape:<14} {seed:>4} {len(chosen.sizes):>5} {chosen.num_graphs:>6} {chosen.held.in_sample:>9.2%}"
                f" {ours:>8.2%} {ladder:>7.2%} {axis_eager:>10.1%} {slots:>6.1%} {picked_slots:>12.1%}"
                f" {picked_held:>8.1%}  {list(picked['lora'])}"
            )
            print(row)
    print(f"largest held-out token waste above the ladder's at as many sizes: {worst:.2%} (goal <= 0.00%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
