"""What publishing each capture forward's collectives costs a capture pass with tensor-parallel peers.

With peers (not on CUDA), every functional collective a capture forward issues (warmups, the
recording, verification's eager runs and replays) is first published to the process group's
store (`graphcap.distributed.ledger`), so a rank whose forward fails part-way can issue what its
peers wait in; replays and eager steps outside capture publish nothing. This spawns two gloo ranks
on a TCP store on loopback, builds a tensor-parallel MLP whose forward holds `--layers` functional
all-reduces, and times `CaptureManager.capture()` on both ranks, in lockstep, interleaved in rounds
(the order alternating): with the ledger (the default) and without it (the manager's ledger
removed). Rank 0 prints the medians and spreads, the descriptors published per pass and the cost
per descriptor; the store's own latency is timed beside it.

    python tools/bench_ledger.py            # 9 rounds
    python tools/bench_ledger.py --quick    # 2 rounds, to see that it runs

Run from the repository root with graphcap installed (or `PYTHONPATH=.`). Results are on stdout;
see docs/BENCHMARKS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphcap import CaptureManager, Parallel, load_config

OVERRIDES = {
    "device": "cpu",
    "model.vocab_size": 128,
    "batching.max_num_seqs": 8,
    "batching.max_num_tokens": 32,
    "kv_cache.block_size": 8,
    "kv_cache.num_blocks": 32,
    "kv_cache.max_model_len": 64,
    "capture.sizes": [1, 2, 4, 8],
    "capture.num_warmups": 1,
}


class ShardedMLP(torch.nn.Module):
    """`layers` row-parallel blocks, each ending in a functional all-reduce over `group`."""

    def __init__(self, layers: int, group) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(128, 32, generator=g) * 0.5, requires_grad=False)
        self.w = torch.nn.Parameter(torch.randn(layers, 32, 32, generator=g) * 0.1, requires_grad=False)
        self.group_name = group.group_name

    def forward(self, inputs) -> torch.Tensor:
        x = self.emb[inputs.input_ids.long()]
        for w in self.w:
            out = torch.ops._c10d_functional.all_reduce(x @ w, "sum", self.group_name)
            x = x + torch.ops._c10d_functional.wait_tensor(out)
        return x


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    config = load_config(overrides=OVERRIDES)
    group = dist.group.WORLD
    managers = {}
    for ledger in (True, False):
        manager = CaptureManager(ShardedMLP(args.layers, group), config, backend="emulated",
                                 parallel=Parallel(tp_group=group, timeout=120.0), progress=False)  # fmt: skip
        if not ledger:
            manager._ledger = None
        managers[ledger] = manager
    published = managers[True]._ledger.published
    managers[True].capture()
    per_pass = managers[True]._ledger.published - published
    samples: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for ledger in (True, False) if round_ % 2 == 0 else (False, True):
            dist.barrier()
            start = time.perf_counter()
            managers[ledger].capture()
            samples[ledger].append(time.perf_counter() - start)
    store = dist.distributed_c10d._get_default_store()
    store_us = []
    for i in range(2000):
        start = time.perf_counter_ns()
        store.set(f"bench/{rank}/{i}", b"x" * 160)
        store_us.append((time.perf_counter_ns() - start) / 1000)
    if rank == 0:
        on, off = (np.array(samples[key]) * 1000 for key in (True, False))
        print(f"# {platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, 2 gloo ranks (TCP store), "
              f"{args.layers} all-reduces per forward, {args.rounds} rounds")  # fmt: skip
        print(f"{'capture() pass':<28}{'median ms':>12}{'p10-p90 ms':>18}")
        for name, values in (("with the ledger", on), ("without", off)):
            p10, p90 = np.percentile(values, [10, 90])
            print(f"{name:<28}{np.median(values):>12.1f}{f'{p10:.1f}-{p90:.1f}':>18}")
        added = np.median(on) - np.median(off)
        print(f"descriptors published per pass: {per_pass}; added per pass {added:.1f} ms "
              f"({100 * added / np.median(off):.1f} %), {1000 * added / max(per_pass, 1):.0f} us per descriptor; "
              f"store.set alone: median {np.median(store_us):.0f} us")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
