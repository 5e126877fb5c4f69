"""Per-step cost of the flight recorder (`report.flight_steps`) at 256 decode requests.

What the recorder adds to a step: `note` (the step's mode) and `record` (one copy of the staged
rows into the ring), timed on the manager's staging path (`_stage`: stage, invariants, record,
upload) with the recorder on and off, interleaved in one process (rounds of `--calls` calls of
each case, the order alternating every round), on the buffers of `tools/bench_stage.py` (1024
requests of 64 blocks at most, 4096 tokens) and a 256-request decode naming the persistent block
table. "on - off" is each round's median difference; the table shows the median over rounds and
its p10-p90. `record` alone is the copy itself.

    python tools/bench_recorder.py               # 30 rounds x 2000 calls
    python tools/bench_recorder.py --quick       # a few rounds, to see that it runs
    python tools/bench_recorder.py --steps 16    # a longer ring (the copy is the same)
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from _sampling import measure
from bench_stage import OVERRIDES

from graphcap import CaptureManager, GraphKey, StepBatch, load_config
from graphcap.keys import Mode
from graphcap.postmortem.recorder import FlightRecorder

NUM_REQS = 256
GOAL_US = 1.0


class Tiny(torch.nn.Module):
    def forward(self, inputs) -> torch.Tensor:
        return inputs.input_ids


def build(steps: int) -> tuple[CaptureManager, StepBatch, GraphKey]:
    overrides = {**OVERRIDES, "capture.mode": "none", "checks.invariants": "basic", "report.flight_steps": steps}
    config = load_config(overrides=overrides)
    manager = CaptureManager(Tiny(), config, progress=False)
    rng = np.random.default_rng(0)
    kv = config.kv_cache
    seq = rng.integers(1, kv.max_model_len + 1, NUM_REQS).astype(np.int32)
    for i, s in enumerate(seq):
        blocks = -(-int(s) // kv.block_size)
        manager.block_table.set_row(
            i, list(range(1 + i * kv.max_blocks_per_req, 1 + i * kv.max_blocks_per_req + blocks))
        )
    ids = rng.integers(0, config.model.vocab_size, NUM_REQS).astype(np.int32)
    batch = StepBatch(np.ones(NUM_REQS, np.int32), seq, ids, manager.block_table)
    return manager, batch, GraphKey(NUM_REQS, NUM_REQS, True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 calls (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per case and round")
    parser.add_argument("--steps", type=int, default=4, help="report.flight_steps (the ring's length)")
    args = parser.parse_args(argv)
    rounds, calls = (3, 200) if args.quick else (args.rounds, args.calls)
    torch.set_num_threads(1)
    manager, batch, key = build(args.steps)
    recorder: FlightRecorder = manager._flight
    inputs = manager._stage(batch, key, phase="replay")

    def on() -> None:
        manager._flight = recorder
        recorder.note(Mode.FULL, "")
        manager._stage(batch, key, phase="replay")

    def off() -> None:
        manager._flight = None
        manager._stage(batch, key, phase="replay")

    def record() -> None:
        recorder.record(inputs, False, True)

    cases = {"stage, recorder on": on, "stage, recorder off": off, "record alone": record}
    names = list(cases)
    medians = {name: np.empty(rounds) for name in names}
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            medians[name][round_] = np.median(measure(cases[name], calls, warmup=calls // 10))
    manager._flight = recorder
    print(f"# bench_recorder: torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}")
    copied = sum(span.nbytes for span in recorder._plan(key.num_tokens, NUM_REQS).spans)
    width = inputs.host.block_table.shape[1]
    print(f"# decode of {NUM_REQS} requests ({width} block-table columns), {recorder.num_steps} steps in the ring, "
          f"slot copy {copied} bytes; {rounds} rounds x {calls} calls; 1 torch thread")  # fmt: skip
    header = f"{'per step':<24} {'median':>9} {'p10':>8} {'p90':>8}"
    print(header)
    print("-" * len(header))
    for name in names:
        p10, p50, p90 = np.percentile(medians[name], [10, 50, 90])
        print(f"{name:<24} {p50:>7.2f}us {p10:>6.2f}us {p90:>6.2f}us")
    p10, p50, p90 = np.percentile(medians["stage, recorder on"] - medians["stage, recorder off"], [10, 50, 90])
    print(f"{'on - off':<24} {p50:>7.2f}us {p10:>6.2f}us {p90:>6.2f}us")
    print(f"goal: on - off <= about {GOAL_US:g} us per step: {p50:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
