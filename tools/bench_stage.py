"""Per-step host cost of staging: `StepBatch` + `PersistentBuffers.stage` + `check_invariants`.

Measures what every step pays on the host before a graph replays: build the `StepBatch`
from the scheduler's numpy arrays, stage it into the persistent buffers (real rows and
padded tail), and run the `basic` invariants. Beside it, in the same run, a straightforward
per-request Python builder (lists filled in a loop per request and token, then one
`torch.tensor` per field), the way a dummy run is often written by hand.

    python tools/bench_stage.py            # the full table (about a minute)
    python tools/bench_stage.py --quick    # a few repetitions, to see that it runs
    python tools/bench_stage.py --compare  # graphcap vs a vLLM-style host step (tools/vllm_prep.py)
    python tools/bench_stage.py --compare --peer-copies on   # ... with both sides' uploads
    python tools/bench_stage.py --groups   # a second KV-cache group: kv_cache.groups vs engine buffers
    python tools/bench_stage.py --levels   # check_invariants basic and full, and full's rule-by-rule checks

`--compare` times graphcap's two per-step paths against a numpy re-implementation of vLLM
v1's host-side input preparation (`tools/vllm_prep.py`; its docstring lists the vLLM steps
it includes and omits) on decode steps of 1 to 1024 requests and one mixed step:

- graphcap: `StepBatch` with a fresh block table array + `stage` + `check_invariants(basic)`;
- table: the same with the persistent block table (`buffers.block_table`), its rows
  written once before timing as vLLM's `add_request` writes its `BlockTable` rows;
- vllm-style: `prepare_inputs`. `--peer-copies off` (the default): the metadata
  computation only, no uploads and no pad fills (on a CPU an upload is a memcpy, so this
  is the cheaper, stricter peer). `--peer-copies on`: its six uploads (as copies into
  separate CPU tensors) and the two tail fills that precede them; graphcap's steps then
  also make the one upload they make on CUDA (a copy of the packed prefix).

All three first must produce the same real rows; then they run interleaved in rounds (one
block of calls each per round, the order rotating), so drift in the machine's speed hits
them alike. A ratio is graphcap's median over the vLLM-style median; the spreads are those
of the per-round median ratios (graphcap, then table).

Results are on stdout; see docs/BENCHMARKS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from _sampling import measure
from _stage_modes import compare, groups, levels
from _stage_steps import OVERRIDES, graphcap_step, make_cases, python_step

from graphcap.batch import StepBatch
from graphcap.config import load_config
from graphcap.keys import KeyRegistry
from graphcap.staging import PersistentBuffers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few repetitions (seconds, for tests)")
    parser.add_argument("--repeats", type=int, default=3000, help="timed steps per case (graphcap)")
    parser.add_argument("--compare", action="store_true", help="graphcap vs a vLLM-style host step (vllm_prep.py)")
    parser.add_argument("--levels", action="store_true", help="check_invariants basic vs full vs rule by rule")
    parser.add_argument("--rounds", type=int, default=50, help="--compare: interleaved rounds per case")
    parser.add_argument("--calls", type=int, default=100, help="--compare: timed calls per side per round")
    parser.add_argument(
        "--peer-copies",
        choices=("on", "off"),
        default="off",
        help="--compare: off (default): the vLLM-style step computes the metadata only; on: it also uploads "
        "(six copies, two tail fills) and graphcap also does its one upload copy",
    )
    parser.add_argument(
        "--groups", action="store_true", help="a second KV-cache group: kv_cache.groups vs two engine buffers"
    )
    args = parser.parse_args(argv)
    if args.groups:
        return groups(4, 10, 5) if args.quick else groups(args.rounds, args.calls, warmup=200)
    if args.levels:
        return levels(4, 10, 5) if args.quick else levels(args.rounds, args.calls, warmup=200)
    if args.compare:
        copies = args.peer_copies == "on"
        if args.quick:
            return compare(rounds=4, calls=10, warmup=5, peer_copies=copies)
        return compare(args.rounds, args.calls, warmup=200, peer_copies=copies)
    repeats = 20 if args.quick else args.repeats
    warmup = 5 if args.quick else 300
    # The Python builder is ~100x slower; fewer samples give the same median precision.
    builder_repeats = 3 if args.quick else max(5, repeats // 10)

    config = load_config(overrides=OVERRIDES)
    registry = KeyRegistry.from_config(config)
    buffers = PersistentBuffers.from_config(config, "cpu")
    kv = config.kv_cache

    print(f"# bench_stage: torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}")
    print(f"# per step: StepBatch + stage + check_invariants(basic); {repeats} steps after {warmup} warm-up")
    header = f"{'case':<28} {'key':<28} {'graphcap med':>12} {'p90':>8} {'python med':>11} {'p90':>9} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for case in make_cases(config, registry):
        ours = measure(graphcap_step(buffers, case), repeats, warmup)
        lists = (case.query_lens.tolist(), case.seq_lens.tolist(), case.input_ids.tolist(), case.block_table.tolist())

        def builder(lists=lists, key=case.key):
            return python_step(*lists, key, kv.block_size, kv.max_blocks_per_req, config.padding)

        # Same values as the staged buffers: the comparison is like for like.
        inputs = buffers.stage(StepBatch(case.query_lens, case.seq_lens, case.input_ids, case.block_table), case.key)
        for name, tensor in builder().items():
            torch.testing.assert_close(getattr(inputs, name), tensor, rtol=0, atol=0, msg=name)
        theirs = measure(builder, builder_repeats, max(1, warmup // 10))
        med, p90 = np.median(ours), np.percentile(ours, 90)
        bmed, bp90 = np.median(theirs), np.percentile(theirs, 90)
        print(
            f"{case.name:<28} {case.key!s:<28} {med:>10.1f}us {p90:>6.1f}us "
            f"{bmed:>9.0f}us {bp90:>7.0f}us {bmed / med:>7.0f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
