"""mini_engine's tensor- and data-parallel runs: a gloo world of TP x DP ranks on this machine.

Each rank builds the engine's model and shards its linears the Megatron way (`shard`): in every
layer the attention output projection and the MLP's down projection are row-parallel (each
rank multiplies its slice of the input columns; an all-reduce sums the partial products) and
the MLP's gate/up projection is column-parallel (each rank keeps its slice of the rows).
Attention and the KV cache are replicated. The all-reduces are `torch.ops._c10d_functional`
ops, which CUDA and the emulated backend both capture. Ranks `d * tp .. d * tp + tp - 1` are
the TP group of DP replica `d`; ranks with the same TP rank form a DP group. Each replica runs
the engine with seed `seed + d` and checks every step against eager and a dense single-process
model, so its token streams must equal the single-process run with that seed.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F

from graphcap.testing.ranks import rank_context

WORLD_TIMEOUT_S = 900.0
"""The whole world, spawn to exit: a rank that hangs is killed and the run fails."""


def shard(model: Any, rank: int, world: int, group: Any) -> None:
    """Make `model.llama`'s layers this rank's tensor-parallel shard (in place; see the module doc)."""
    name = group.group_name

    def all_reduce(y: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(y, "sum", name))

    for layer in model.llama.layers:
        E, HD = layer.o_proj.shape
        Fs = layer.down_proj.shape[1]
        if HD % world or Fs % world:
            raise ValueError(f"--tp {world} must divide the attention width {HD} and the MLP width {Fs}")
        cols = slice(rank * HD // world, (rank + 1) * HD // world)
        ffn = slice(rank * Fs // world, (rank + 1) * Fs // world)
        o_proj = layer.o_proj[:, cols].clone()  # [E, HD / world]
        gate_up = torch.cat((layer.gate_up_proj[:Fs][ffn], layer.gate_up_proj[Fs:][ffn]))  # [2 Fs / world, E]
        down_proj = layer.down_proj[:, ffn].clone()  # [E, Fs / world]
        norm, eps = layer.mlp_norm, layer.eps

        def finish(x, attn, o_proj=o_proj, gate_up=gate_up, down_proj=down_proj, cols=cols, norm=norm, eps=eps):
            x = x + all_reduce(F.linear(attn[:, cols], o_proj))
            h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            gate, up = F.linear((h * norm.float()).to(x.dtype), gate_up).chunk(2, dim=-1)
            return x + all_reduce(F.linear(F.silu(gate) * up, down_proj))

        layer.finish = finish


def run(args: Any) -> int:
    """Spawn the TP x DP world, wait for it (bounded), print each replica's summary; 0 when all passed."""
    world = args.tp * args.dp
    with tempfile.TemporaryDirectory(prefix="mini_engine_parallel") as directory:
        ctx = rank_context()  # forked from a server that preloaded torch and graphcap
        procs = [ctx.Process(target=_rank, args=(rank, args, directory), daemon=True) for rank in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + WORLD_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in hung:
            procs[rank].kill()
            procs[rank].join()
        results = [_result(os.path.join(directory, f"rank{rank}.pkl")) for rank in range(world)]
    codes = [proc.exitcode for proc in procs]
    failed = [(rank, r["error"]) for rank, r in enumerate(results) if "error" in r]
    if hung or any(codes) or failed:
        print(f"parallel run failed: hung ranks {hung}, exit codes {codes}", file=sys.stderr)
        for rank, error in failed:
            print(f"rank {rank}:\n{error}", file=sys.stderr)
        return 1
    print(f"mini engine: tensor parallel {args.tp} x data parallel {args.dp} ({world} gloo ranks), {args.steps} steps")
    for replica in range(args.dp):
        result = results[replica * args.tp]
        print(f"  replica {replica} (seed {args.seed + replica}): {result['summary']}")
        print(f"  replica {replica} token streams digest: {result['digest']}")
    print("  every step of every rank: graph == eager == dense logits, identical token streams")
    return 0


def _result(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {"error": "no result (the rank died)"}
    with open(path, "rb") as f:
        return pickle.load(f)


def _rank(rank: int, args: Any, directory: str) -> None:
    result: dict[str, Any]
    try:
        torch.set_num_threads(1)
        result = _serve(rank, args, directory)
    except BaseException:
        result = {"error": traceback.format_exc()}
    try:
        with open(os.path.join(directory, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # A return, not os._exit: multiprocessing then runs this rank's finalizers (which unlink its semaphores, tqdm's
    # write lock among them, instead of leaving the resource tracker to report them leaked) and ends the process
    # with os._exit itself, so no interpreter teardown waits on gloo's threads.


def _serve(rank: int, args: Any, directory: str) -> dict[str, Any]:
    import mini_engine
    import torch.distributed as dist

    from graphcap import CaptureManager, Parallel, load_config

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(directory, 'store')}",
        rank=rank,
        world_size=args.tp * args.dp,
        timeout=datetime.timedelta(seconds=300),
    )
    tp_groups = [dist.new_group(list(range(d * args.tp, (d + 1) * args.tp))) for d in range(args.dp)]
    dp_groups = [dist.new_group(list(range(t, args.tp * args.dp, args.tp))) for t in range(args.tp)]
    replica, tp_rank = divmod(rank, args.tp)
    config = load_config(overrides=mini_engine.CONFIG)
    model = mini_engine.AdaptedLlama(config)
    if args.tp > 1:
        shard(model, tp_rank, args.tp, tp_groups[replica])
    manager = CaptureManager(
        model,
        config,
        progress=False,
        buffers=mini_engine.BUFFERS,
        parallel=Parallel(
            dp_group=dp_groups[tp_rank] if args.dp > 1 else None,
            tp_group=tp_groups[replica] if args.tp > 1 else None,
        ),
    )
    manager.capture()
    engine = mini_engine.MiniEngine(manager, mini_engine.AdaptedLlama(config), args.seed + replica, idle_steps=True)
    for index in range(args.steps):
        engine.step(index)
    return {"summary": engine.summary(), "digest": engine.digest()}
