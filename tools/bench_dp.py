"""Per-step cost of data-parallel agreement: one gloo all-reduce per step, against none.

With a process group, `CaptureManager.dispatch` adds one all-reduce (MAX) of four int64
values (tokens, cannot use a graph, not uniform, requests) on a CPU group to every step,
then dispatches again on the reduced values. This spawns a gloo world on the CPU (file
store in a temporary directory) and times, on every rank, in lockstep:

- `KeyRegistry.dispatch` and `CaptureManager.dispatch` without a group: a step without DP;
- `dist.all_reduce` of four int64 values: the transport floor;
- `DataParallelSync.reduce_max`: the collective as graphcap calls it;
- `CaptureManager.dispatch` with the group: what a data-parallel step pays.

Ranks use different batches (rank 0 decodes, rank 1 runs a mixed step), as in serving.
Rank 0 prints its own samples; the numbers are host latency of a loopback collective, so
they depend on the machine's load much more than bench_stage's do.

    python tools/bench_dp.py            # 5000 steps per row (about a minute)
    python tools/bench_dp.py --quick    # 200 steps per row, to see that it runs

Run from the repository root with graphcap installed (or `PYTHONPATH=.`). Results are on
stdout; see docs/BENCHMARKS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _sampling import measure

from graphcap import CaptureManager, StepBatch, load_config
from graphcap.distributed import DataParallelSync
from graphcap.models import build_model

OVERRIDES = {
    "device": "cpu",
    "capture.max_size": 64,
    "batching.max_num_seqs": 32,
    "model.num_layers": 1,
    "model.hidden_size": 64,
}


def rank_batch(rank: int) -> StepBatch:
    """Rank 0: 24 decode requests (pads to 24); others: a mixed step of 40 tokens (pads to 40)."""
    if rank == 0:
        q = np.ones(24, dtype=np.int32)
    else:
        q = np.full(8, 5, dtype=np.int32)
    return StepBatch(q, q + 100)


def run_rank(rank: int, world_size: int, store: str, repeats: int, warmup: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        config = load_config(overrides=OVERRIDES)
        model = build_model(config)
        solo = CaptureManager(model, config, progress=False)
        manager = CaptureManager(model, config, group=dist.group.WORLD, dp_timeout=120.0, progress=False)
        for registry in (solo.registry, manager.registry):
            for key in registry.planned:  # dispatch only: mark every key captured, capture nothing
                registry.mark_captured(key)
        sync = DataParallelSync(dist.group.WORLD, timeout=120.0)
        batch = rank_batch(rank)
        registry = solo.registry
        uniform = batch.is_uniform(registry.uniform_query_len)
        own_key = registry.dispatch(batch.num_tokens, batch.num_reqs, uniform).key
        packed = torch.zeros(4, dtype=torch.int64)
        values = [batch.num_tokens, 0, 1, batch.num_reqs]

        rows = [
            ("KeyRegistry.dispatch (no group)", lambda: registry.dispatch(batch.num_tokens, batch.num_reqs, uniform)),
            ("CaptureManager.dispatch (no group)", lambda: solo.dispatch(batch)),
            ("dist.all_reduce 4 x int64 (gloo)", lambda: dist.all_reduce(packed, op=dist.ReduceOp.MAX)),
            ("DataParallelSync.reduce_max", lambda: sync.reduce_max(values, "bench")),
            ("CaptureManager.dispatch (DP step)", lambda: manager.dispatch(batch)),
        ]
        agreed = manager.dispatch(batch)
        results = [(name, measure(fn, repeats, warmup, before=dist.barrier)) for name, fn in rows]
        if rank == 0:
            print(
                f"# bench_dp: torch {torch.__version__}, gloo, {world_size} ranks on "
                f"{os.cpu_count()} CPUs, python {platform.python_version()}"
            )
            print(f"# rank 0 key {own_key}, agreed {agreed}; {repeats} steps per row after {warmup} warm-up")
            header = f"{'per step (rank 0)':<36} {'median':>9} {'p90':>9}"
            print(header)
            print("-" * len(header))
            for name, samples in results:
                print(f"{name:<36} {np.median(samples):>7.1f}us {np.percentile(samples, 90):>7.1f}us")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 steps per row (seconds, for tests)")
    parser.add_argument("--repeats", type=int, default=5000, help="timed steps per row")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (processes) in the gloo world")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2; got {args.world_size}")
    repeats = 200 if args.quick else args.repeats
    warmup = 20 if args.quick else 500
    with tempfile.TemporaryDirectory(prefix="bench_dp") as directory:
        store = os.path.join(directory, "store")
        mp.spawn(run_rank, args=(args.world_size, store, repeats, warmup), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
