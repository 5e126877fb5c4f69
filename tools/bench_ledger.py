"""What publishing each capture forward's collectives costs a capture pass with tensor-parallel peers.

With peers (not on CUDA), every functional collective a capture forward issues (warmups, the
recording, verification's eager runs and replays) is first published to the process group's
store (`graphcap.distributed.ledger`), so a rank whose forward fails part-way can issue what its
peers wait in; replays and eager steps outside capture publish nothing. This spawns two gloo ranks
on a TCP store on loopback, builds a tensor-parallel MLP whose forward holds `--layers` functional
all-reduces, and times `CaptureManager.capture()` on both ranks, in lockstep, interleaved in rounds
(the order alternating): with the ledger (the default), with the ledger watching but sending
nothing (its `publish` a no-op: the dispatch mode around each forward and the tape's observed
calls alone), and without it (the manager's ledger removed). Rank 0 prints the medians and
spreads, each row's ratio to the pass without the ledger in the same round (median, p10-p90),
the descriptors published per pass and the cost per descriptor; the store's own latency is
timed beside it.

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
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphcap import CaptureManager, Parallel, load_config
from graphcap.testing.ranks import rank_context

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


VARIANTS = ("with the ledger", "watched, nothing sent", "without the ledger")
"""What each row runs: the manager as it is; its ledger with `publish` a no-op; no ledger at all."""


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
            x = torch.tanh(x + torch.ops._c10d_functional.wait_tensor(out))  # bounded: no overflow
        return x


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    config = load_config(overrides=OVERRIDES)
    group = dist.group.WORLD
    managers = {}
    for variant in VARIANTS:
        manager = CaptureManager(ShardedMLP(args.layers, group), config, backend="emulated",
                                 parallel=Parallel(tp_group=group, timeout=120.0), progress=False)  # fmt: skip
        if variant == "watched, nothing sent":  # the dispatch mode and the tape's calls, no store traffic
            manager._ledger.publish = lambda func, args, kwargs: None
        elif variant == "without the ledger":
            manager._ledger = None
        managers[variant] = manager
    ledger = managers["with the ledger"]._ledger
    published = ledger.published
    managers["with the ledger"].capture()
    per_pass = ledger.published - published
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            managers[variant].capture()
            samples[variant].append(time.perf_counter() - start)
    store = dist.distributed_c10d._get_default_store()
    store_us = []
    for i in range(2000):
        start = time.perf_counter_ns()
        store.set(f"bench/{rank}/{i}", b"x" * 160)
        store_us.append((time.perf_counter_ns() - start) / 1000)
    if rank == 0:
        medians = {variant: float(np.median(samples[variant])) * 1000 for variant in VARIANTS}
        print(f"# {platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, 2 gloo ranks (TCP store), "
              f"{args.layers} all-reduces per forward, {args.rounds} rounds")  # fmt: skip
        print(f"{'capture() pass':<28}{'median ms':>12}{'p10-p90 ms':>18}{'/ without, per round':>24}")
        alone = np.array(samples["without the ledger"])
        for variant in VARIANTS:
            values = np.array(samples[variant])
            p10, p90 = np.percentile(values * 1000, [10, 90])
            ratios = values / alone  # the same round: the load both saw
            r10, r50, r90 = np.percentile(ratios, [10, 50, 90])
            print(f"{variant:<28}{medians[variant]:>12.1f}{f'{p10:.1f}-{p90:.1f}':>18}"
                  f"{f'{r50:.2f}x ({r10:.2f}-{r90:.2f})':>24}")  # fmt: skip
        base = medians["without the ledger"]
        sent = medians["with the ledger"] - medians["watched, nothing sent"]
        added = medians["with the ledger"] - base
        print(f"descriptors published per pass: {per_pass}; the ledger adds {added:.1f} ms a pass "
              f"({100 * added / base:.1f} %), "
              f"of which the store traffic {sent:.1f} ms ({1000 * sent / max(per_pass, 1):.0f} us a descriptor); "
              f"store.set alone: median {np.median(store_us):.0f} us")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--layers", type=int, default=16, help="all-reduces per forward (default 16)")
    parser.add_argument("--quick", action="store_true", help="2 rounds (seconds, for tests)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.layers < 1:
        parser.error(f"--rounds and --layers must be >= 1; got {args.rounds} and {args.layers}")
    if args.quick:
        args.rounds = 2
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rank_context()  # ranks fork from a server that preloaded torch and graphcap
    mp.start_processes(_rank, args=(2, port, args), nprocs=2, start_method="forkserver")
    return 0


if __name__ == "__main__":
    sys.exit(main())
