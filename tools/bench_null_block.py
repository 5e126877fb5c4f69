"""The per-step cost of the `basic` invariants' null-block rule: `check_invariants(basic)` on real steps
(the rule on) against the same steps checked as graphcap's own batches (`dummy=True`, the rule off).

Same steps, buffers and timing harness as `tools/bench_stage.py --levels` (one staged step per case,
persistent block table, every request owning distinct blocks, never block 0); interleaved rounds.

    python tools/bench_null_block.py            # ~10 s
    python tools/bench_null_block.py --quick    # a few repetitions (tests)
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from _stage_steps import OVERRIDES, interleaved, make_cases

from graphcap.batch import StepBatch
from graphcap.checks.invariants import check_invariants
from graphcap.config import load_config
from graphcap.keys import KeyRegistry
from graphcap.staging import PersistentBuffers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=50, help="interleaved rounds per case")
    args = parser.parse_args(argv)
    rounds, calls, warmup = (3, 20, 5) if args.quick else (args.rounds, 200, 200)
    torch.set_num_threads(1)
    config = load_config(overrides=OVERRIDES)
    registry = KeyRegistry.from_config(config)
    buffers = PersistentBuffers.from_config(config, "cpu")
    print(f"# bench_null_block: numpy {np.__version__}, python {platform.python_version()}")
    print(f"# interleaved: {rounds} rounds x {calls} calls each; spread = p10-p90 of the per-round differences")
    header = f"{'case':<28} {'basic':>8} {'no rule':>8} {'rule':>7} {'p10-p90':>13}"
    print(header)
    print("-" * len(header))
    for case in make_cases(config, registry):
        table = buffers.block_table
        table.reset()
        for row, blocks in enumerate(case.block_table):
            table.set_row(row, blocks)
        inputs = buffers.stage(StepBatch(case.query_lens, case.seq_lens, case.input_ids, table), case.key)
        steps = [
            lambda inputs=inputs: check_invariants(inputs, "basic"),
            lambda inputs=inputs: check_invariants(inputs, "basic", dummy=True),
        ]
        on, off = (np.median(s, axis=1) for s in interleaved(steps, rounds, calls, warmup))
        lo, hi = np.percentile(on - off, [10, 90])
        print(
            f"{case.name:<28} {np.median(on):>6.2f}us {np.median(off):>6.2f}us {np.median(on - off):>5.2f}us "
            f"{lo:>6.2f}-{hi:<5.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
