"""Cost of `checks.sample_every` (live steps compared with eager), per replayed step, against the goal of 1%.

Three managers over the reference model (`graphcap.testing.TINY`, `capture.mode: full`), each with its own
copy of the model, replay the same 4-request decode step; interleaved in one process (rounds of `--calls`
calls of each case, the order rotating every round):

- `sample_every 0`: sampling off (the default): the plain replayed step;
- `sample_every 1000`: the setting the goal is stated for (one step in 1000 also runs eagerly);
- `sample_every 1`: every step sampled: what one sampled step costs (eager forward, second staging, the
  gathers and the comparison) on top of a replay.

Each call is timed twice: wall clock and the thread's CPU time (`time.thread_time_ns`). On the CPU
backend a step's work is the thread's CPU time, which preemption by other jobs on a shared machine does
not inflate (wall time does, and more for a longer call); the goal is judged on CPU time, the wall figures
printed beside it.

The overhead at N = 1000 is `(median(every 1) - median(every 0)) / 1000` (a sampled step's extra cost,
amortized) plus what an unsampled step pays (`StepSampler.due()`, a counter, timed alone), as a share of
the plain step's median. The direct difference of the `every 1000` and `every 0` medians is printed beside
it: on a shared machine it is within the noise of a sub-microsecond effect.

    python tools/bench_sampling.py            # 20 rounds x 500 calls
    python tools/bench_sampling.py --quick    # a few rounds, to see that it runs
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

import numpy as np
import torch

from graphcap import CaptureManager, StepBatch, load_config
from graphcap.checks.sampling import StepSampler
from graphcap.models import build_model
from graphcap.testing import TINY

GOAL = 0.01
"""At most 1% of a replayed step at `sample_every: 1000`."""


def measure(fn, repeats: int, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """Microseconds per call, wall clock and thread CPU time, one sample per call, GC off while sampling."""
    for _ in range(warmup):
        fn()
    wall, cpu = np.empty(repeats), np.empty(repeats)
    gc.disable()
    try:
        for i in range(repeats):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            fn()
            cpu[i], wall[i] = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
    finally:
        gc.enable()
    return wall / 1000.0, cpu / 1000.0


def manager(every: int) -> CaptureManager:
    config = load_config(overrides={**TINY, "checks.sample_every": every})
    built = CaptureManager(build_model(config), config, progress=False)
    built.capture()
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 100 calls (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per case")
    parser.add_argument("--calls", type=int, default=500, help="timed calls per case and round")
    args = parser.parse_args(argv)
    rounds, calls = (3, 100) if args.quick else (args.rounds, args.calls)
    torch.set_num_threads(1)
    table = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    batch = StepBatch([1, 1, 1, 1], [5, 9, 3, 7], [11, 12, 13, 14], table)
    managers = {f"sample_every {n}": manager(n) for n in (0, 1000, 1)}
    for built in managers.values():
        built.execute(batch)
        if built.last_key not in built.graphs:
            raise SystemExit(f"the step did not replay ({built.last_key}): the benchmark times replayed steps")
    names = list(managers)
    wall: dict[str, list[np.ndarray]] = {name: [] for name in names}
    cpu: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for round_ in range(rounds):
        for j in range(len(names)):
            name = names[(round_ + j) % len(names)]
            step = managers[name].execute
            w, c = measure(lambda step=step: step(batch), calls, warmup=calls // 10)
            wall[name].append(w)
            cpu[name].append(c)
    print(f"# bench_sampling: torch {torch.__version__}, python {platform.python_version()}, 1 thread")
    print(f"# TINY reference model, a 4-request decode step; {rounds} interleaved rounds x {calls} calls per case")
    header = (
        f"{'per replayed step':<22} {'cpu median':>11} {'cpu p10-p90':>19} {'wall median':>12} {'wall p10-p90':>19}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        c, w = np.concatenate(cpu[name]), np.concatenate(wall[name])
        spread_c = f"{np.percentile(c, 10):.1f}-{np.percentile(c, 90):.1f}us"
        spread_w = f"{np.percentile(w, 10):.1f}-{np.percentile(w, 90):.1f}us"
        print(f"{name:<22} {np.median(c):>9.1f}us {spread_c:>19} {np.median(w):>10.1f}us {spread_w:>19}")
    off, every_1000, every_1 = (np.median(np.concatenate(cpu[name])) for name in names)
    sampler = StepSampler(1 << 62)
    counter = float(np.median(measure(sampler.due, 20000, warmup=1000)[1]))
    sampled = every_1 - off
    amortized = sampled / 1000 + counter
    print(f"one sampled step costs {sampled:.1f} us CPU more than a replay ({sampled / off:.2f} steps)")
    print(
        f"overhead at sample_every 1000: {amortized:.2f} us per step = {100 * amortized / off:.3f}% of a step "
        f"(goal: <= {100 * GOAL:g}%; sampled steps amortized {sampled / 1000:.2f} us, the counter {counter:.2f} us); "
        f"direct median difference every 1000 - every 0: {every_1000 - off:+.1f} us CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
