"""Per-replay cost of the static-input check (`graphcap.guard.StaticGuard`) at 300 static tensors.

Every replay, at every invariant level, refuses a static tensor that moved since capture. This
times, interleaved in one process (rounds of each, the order alternating), on a module tree of
150 `nn.Linear` (300 parameters), what one replay pays for that check:

- `guard.check()`: the O(1) flag (replacements caught by module registration hooks) plus the
  `data_ptr` sweep of every recorded tensor (storage swaps: `.data =`, `set_`);
- `guard.check(sweep=False)`: the O(1) flag alone (what `checks.invariants: off` pays);
- the walk it replaces: `named_parameters()` + `named_buffers()` into a dict, then the
  name-by-name `data_ptr` comparison (`CapturedGraph.check_addresses`).

    python tools/bench_guard.py            # 20 rounds x 2000 calls
    python tools/bench_guard.py --quick    # a few rounds, to see that it runs
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from _sampling import measure

from graphcap.guard import StaticGuard

NUM_LINEAR = 150  # 300 parameters (weight and bias each)


def walk_and_compare(model: torch.nn.Module, recorded: dict[str, int]) -> None:
    """What a replay paid before the guard: rebuild the name -> tensor map, compare by name."""
    tensors = {f"model.{n}": t for n, t in model.named_parameters()}
    tensors.update({f"model.{n}": t for n, t in model.named_buffers()})
    for name, ptr in recorded.items():
        if tensors[name].data_ptr() != ptr:
            raise AssertionError(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 100 calls (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per case")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per case and round")
    args = parser.parse_args(argv)
    rounds, calls = (3, 100) if args.quick else (args.rounds, args.calls)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(NUM_LINEAR)))
    guard = StaticGuard()
    statics = guard.collect(model, {})
    guard.arm(statics, model)
    recorded = {name: t.data_ptr() for name, t in statics.items()}
    cases = {
        "guard.check() (flag + data_ptr sweep)": guard.check,
        "guard.check(sweep=False) (flag only)": lambda: guard.check(sweep=False),
        "walk named_parameters + compare": lambda: walk_and_compare(model, recorded),
    }
    samples: dict[str, list[np.ndarray]] = {name: [] for name in cases}
    for round_ in range(rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            samples[name].append(measure(cases[name], calls, warmup=calls // 10))
    print(f"# bench_guard: torch {torch.__version__}, python {platform.python_version()}, 1 thread")
    print(f"# {len(statics)} static tensors; {rounds} interleaved rounds x {calls} calls per case")
    header = f"{'per replay':<40} {'median':>9} {'p10':>8} {'p90':>8} {'round medians min-max':>23}"
    print(header)
    print("-" * len(header))
    for name, parts in samples.items():
        joined = np.concatenate(parts)
        per_round = [np.median(p) for p in parts]
        print(
            f"{name:<40} {np.median(joined):>7.2f}us {np.percentile(joined, 10):>6.2f}us "
            f"{np.percentile(joined, 90):>6.2f}us {min(per_round):>10.2f}-{max(per_round):.2f}us"
        )
    guard.disarm()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
