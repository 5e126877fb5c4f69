"""Per-step cost of agreeing with parallel peers, side by side with the step it guards.

With a data-parallel group, every `CaptureManager.execute` first stages the batch for its own
key (validation), then makes one agreement: a MAX all-reduce of 9 + 2 x world int64 values on a
CPU (gloo) group (the counts, every rank's token count and call, the out-of-step flag), and stages
again when the agreed key differs. With a tensor-parallel group it adds a CRC-32 of the staged host
rows and its agreement, and one more agreement before the launch (every rank's rows passed).
This spawns a gloo world on the CPU (file store in a temporary directory),
captures a small model on the emulated backend, and times on every rank, interleaved in rounds
(the order alternating, every rank in lockstep):

- `execute` without a group: the step (stage, check, replay) of 24 decodes, and of 40 mixed tokens;
- `GroupSync.agree`: the agreement alone, and `dist.all_reduce` of the same 12 int64: the floor;
- `execute` with the DP group: every rank 24 decodes (one key, one staging); and skewed, as in
  serving: rank 0 decodes 24 requests, rank 1 runs a mixed 40-token step, so rank 0 stages
  twice and replays the agreed `mixed(tokens=40, reqs=32)`;
- `execute` with a TP group (both ranks 24 decodes): the step, the digest and its agreements;
- then pairs of one agreement and one bare all-reduce of the same length, call by call (the order
  alternating): their ratio per pair, both seeing the same load.

Rank 0 prints its medians and spreads; the numbers are host latency of a loopback collective
beside an emulated replay, so they depend on the machine's load much more than bench_stage's.

    python tools/bench_dp.py            # 20 rounds of 100 steps per row (a few minutes)
    python tools/bench_dp.py --quick    # 2 rounds of 20 steps, to see that it runs

Run from the repository root with graphcap installed (or `PYTHONPATH=.`). Results are on
stdout; see docs/BENCHMARKS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _sampling import measure

from graphcap import CaptureManager, Parallel, StepBatch, load_config
from graphcap.distributed import GroupSync
from graphcap.models import build_model
from graphcap.testing.ranks import rank_context

OVERRIDES = {
    "device": "cpu",
    "capture.sizes": [24, 40],
    "batching.max_num_seqs": 32,
    "batching.max_num_tokens": 64,
    "model.num_layers": 1,
    "model.hidden_size": 64,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "kv_cache.max_model_len": 128,
    "checks.verify_replay": False,
}


def rank_batch(rank: int) -> StepBatch:
    """Rank 0: 24 decode requests (pads to 24); others: a mixed step of 40 tokens (pads to 40)."""
    q = np.ones(24, dtype=np.int32) if rank == 0 else np.full(8, 5, dtype=np.int32)
    return StepBatch(q, q + 100)


def run_rank(rank: int, world_size: int, store: str, rounds: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300)
    )
    try:
        config = load_config(overrides=OVERRIDES)
        group = dist.group.WORLD
        managers = {
            "solo": CaptureManager(build_model(config), config, backend="emulated", progress=False),
            "dp": CaptureManager(build_model(config), config, backend="emulated", group=group, progress=False),
            "tp": CaptureManager(
                build_model(config), config, backend="emulated", parallel=Parallel(tp_group=group), progress=False
            ),
        }
        for manager in managers.values():
            manager.capture()
        sync = GroupSync(group, timeout=300.0)
        own, decode, mixed = rank_batch(rank), rank_batch(0), rank_batch(1)
        floor = torch.zeros(9 + 2 * world_size, dtype=torch.int64)  # the agreement's length
        calls = [0]

        def agree():
            calls[0] += 1
            sync.agree(calls[0], "execute", [40, 0, 1, 32], value=40)

        rows = [
            ("execute, no group: 24 decodes (the step)", lambda: managers["solo"].execute(decode)),
            ("execute, no group: 40 mixed tokens", lambda: managers["solo"].execute(mixed)),
            (f"dist.all_reduce {floor.numel()} x int64 (gloo)", lambda: dist.all_reduce(floor, op=dist.ReduceOp.MAX)),
            ("GroupSync.agree (the agreement)", agree),
            ("execute, DP: 24 decodes on both ranks", lambda: managers["dp"].execute(decode)),
            ("execute, DP: rank 0 restaged to rank 1's key", lambda: managers["dp"].execute(own)),
            ("execute, TP: 24 decodes (digest + 2 agreements)", lambda: managers["tp"].execute(decode)),
        ]
        agreed = managers["dp"].dispatch(own)
        samples: dict[str, list] = {name: [] for name, _ in rows}
        for round_index in range(rounds):
            order = rows if round_index % 2 == 0 else rows[::-1]
            for name, fn in order:
                samples[name].append(measure(fn, repeats, max(2, repeats // 10), before=dist.barrier))
        pairs = _pairs(agree, lambda: dist.all_reduce(floor, op=dist.ReduceOp.MAX), rounds * repeats)
        if rank == 0:
            _print(world_size, rounds, repeats, agreed, samples)
            _print_pairs(floor.numel(), pairs)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _print(world_size: int, rounds: int, repeats: int, agreed, samples: dict[str, list]) -> None:
    print(
        f"# bench_dp: torch {torch.__version__}, gloo, {world_size} ranks on {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}; emulated backend"
    )
    print(f"# skewed DP step: rank 0 decodes, agreed {agreed}; {rounds} rounds x {repeats} steps per row, interleaved")
    header = f"{'per step (rank 0)':<46} {'median':>9} {'p10':>9} {'p90':>9} {'/ step':>7}"
    print(header)
    print("-" * len(header))
    step = float(np.median(np.concatenate(next(iter(samples.values())))))
    for name, chunks in samples.items():
        values = np.concatenate(chunks)
        median = float(np.median(values))
        p10, p90 = np.percentile(values, [10, 90])
        print(f"{name:<46} {median:>7.1f}us {p10:>7.1f}us {p90:>7.1f}us {median / step:>6.2f}x")


def _pairs(agree, bare, count: int) -> np.ndarray:
    """`count` pairs of one agreement and one bare all-reduce back to back (the order alternating), in lockstep on
    every rank: [pair, (agreement us, all-reduce us)]. Each pair sees the same load, so their ratio is the cost."""
    times = np.zeros((count, 2))
    for i in range(count):
        calls = ((0, agree), (1, bare)) if i % 2 == 0 else ((1, bare), (0, agree))
        for column, fn in calls:
            start = time.perf_counter()
            fn()
            times[i, column] = (time.perf_counter() - start) * 1e6
    return times


def _print_pairs(length: int, pairs: np.ndarray) -> None:
    ratio = pairs[:, 0] / pairs[:, 1]
    p10, p90 = np.percentile(ratio, [10, 90])
    agree, bare = np.median(pairs, axis=0)
    print(
        f"# {len(pairs)} pairs, interleaved call by call: GroupSync.agree {agree:.1f}us, dist.all_reduce {length} x "
        f"int64 {bare:.1f}us (medians); agreement / all-reduce per pair: median {np.median(ratio):.2f}x "
        f"(p10 {p10:.2f}x, p90 {p90:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 steps per row (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    parser.add_argument("--repeats", type=int, default=100, help="timed steps per row per round (default 100)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (processes) in the gloo world")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2; got {args.world_size}")
    rounds, repeats = (2, 20) if args.quick else (args.rounds, args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench_dp") as directory:
        store = os.path.join(directory, "store")
        rank_context()  # ranks fork from a server that preloaded torch and graphcap
        mp.start_processes(
            run_rank, args=(args.world_size, store, rounds, repeats), nprocs=args.world_size, start_method="forkserver"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
