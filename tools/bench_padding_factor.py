"""When padding a step to a larger graph stops paying: replay of a padded graph vs the eager step.

For each graph size P (`--sizes`) a manager captures that one size (`capture.sizes: [P]`,
`capture.max_padding_factor: null`), so a step of n <= P tokens replays the P-token graph. A step
of n tokens (one request: a prefill chunk; and n decode requests of one token) is timed through
`execute` (replay of P) and `eager` (n tokens, unpadded), the two interleaved, `--steps` samples each.
The table gives the medians and the padding factor P / n; the break-even factor is the smallest P / n
at which the replay is slower than eager (padding past it costs more than the graph saves).

    python tools/bench_padding_factor.py [--config PATH] [--sizes 16 64] [--steps N] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import torch

from graphcap import CaptureManager, StepBatch, load_config
from graphcap.config.sections import DEFAULT_MAX_PADDING_FACTOR
from graphcap.models import build_model


def _batches(n: int, block_size: int) -> dict[str, StepBatch]:
    """A prefill chunk of `n` tokens (one request) and `n` one-token decode requests."""
    per_req = -(-(n + 8) // block_size)
    prefill = StepBatch([n], [n], np.arange(n) % 100, np.arange(1, 1 + per_req, dtype=np.int32)[None, :])
    table = np.arange(1, 1 + n * 2, dtype=np.int32).reshape(n, 2)
    decode = StepBatch(np.ones(n, dtype=np.int32), np.full(n, 5), np.arange(n) % 100, table)
    return {"prefill": prefill, "decode": decode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: the embedded default on the CPU)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="graph sizes P")
    parser.add_argument("--steps", type=int, default=15, help="timed samples per step and side")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="P = 8, 3 samples (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, steps = ([8], 3) if args.quick else (args.sizes, args.steps)
    overrides = {} if args.config else {"device": "cpu"}
    print(f"replay of a P-token graph vs the n-token step eagerly (median ms of {steps}; {args.threads} thread(s))")
    print(f"{'P':>4} {'n':>4} {'P/n':>5} {'step':<8} {'replay ms':>10} {'eager ms':>9} {'replay/eager':>12}")
    losing: list[float] = []
    by_factor: dict[float, list[float]] = {}
    for size in sizes:
        config = load_config(
            args.config,
            {**overrides, "capture.sizes": [size], "capture.max_size": size, "capture.max_padding_factor": None},
        )
        manager = CaptureManager(build_model(config), config, progress=False)
        manager.capture()
        n = size
        while n >= 1:
            for kind, batch in _batches(n, config.kv_cache.block_size).items():
                if batch.num_reqs > config.batching.max_num_seqs or manager.dispatch(batch) is None:
                    continue
                times: dict[str, list[float]] = {"replay": [], "eager": []}
                with manager.uncounted():
                    for _ in range(steps + 1):  # the first round warms up and is dropped
                        for side, step in (("replay", manager.execute), ("eager", manager.eager)):
                            began = _now()
                            step(batch)
                            times[side].append((_now() - began) * 1e3)
                replay, eager = (statistics.median(times[side][1:]) for side in ("replay", "eager"))
                factor = size / n
                if replay > eager:
                    losing.append(factor)
                by_factor.setdefault(factor, []).append(replay / eager)
                print(
                    f"{size:>4} {n:>4} {factor:>5.1f} {kind:<8} {replay:>10.3f} {eager:>9.3f} {replay / eager:>12.2f}"
                )
            n //= 2
        manager.release()
    print(f"smallest padding factor at which a replay lost to eager: {min(losing) if losing else 'none'}")
    print("replay / eager by padding factor (min-max over steps and graph sizes):")
    for factor, ratios in sorted(by_factor.items()):
        print(f"  P/n {factor:>5.1f}: {min(ratios):.2f}-{max(ratios):.2f}")
    print(f"capture.max_padding_factor default: {DEFAULT_MAX_PADDING_FACTOR}")
    return 0


def _now() -> float:
    import time

    return time.perf_counter()


if __name__ == "__main__":
    sys.exit(main())
