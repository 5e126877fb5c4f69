"""A small continuous-batching engine on graphcap's public API, checked against eager and a dense model.

What an engine owns, written the plain way: a waiting queue and a running set, a block
allocator that never hands out the null block 0 (freed blocks go back with their stale KV),
chunked prefill under a per-step token budget, decode to a random length, preemption by
recompute when blocks run out, greedy sampling, and two engine buffers (a per-token LoRA-style
adapter index and a per-request temperature). What graphcap owns: padding each step to a
captured size, staging the metadata, checking it, replaying the graph or running eagerly.

Every step is run three ways and must agree: the graph (`manager.execute`), the same step
eagerly (`manager.eager`), and a dense reference that recomputes each request from scratch
with no KV cache, no paging and no padding. Logits are compared with `torch.testing`, and the
sampled token streams must be identical.

The model is hybrid: besides the decoder's KV cache it keeps a sliding-window memory on a second
KV-cache group (`kv_cache.groups`, `graphcap.models.WindowedMemory`) with its own block size and
allocator; blocks that fall out of a request's window go back to the pool and their columns to
the group's null block.

A re-capture while requests are in flight (`--recapture-at STEP`, as after a weight swap)
hands graphcap the free blocks of both groups as scratch and must leave every live request's
KV blocks as they were: the run then prints the same token-stream digest as a run without it.
`--lora` serves LoRA-style adapters from slots (`graphcap.models.adapters`): each step loads the distinct
adapters of its requests into slots (an engine buffer of adapter ids, and each token's slot), and the slot
count is a key axis (`capture.axes: {lora: [0, 1, 2, 4]}`): a step of 3 adapters replays the graph of 4
slots, one of 5 or 6 runs eagerly (reason `above_max_axis.lora`); graph, eager and dense still agree.
`--lifecycle` runs an engine's whole life on the way: a weight swap the guard refuses (the
engine re-captures and retries the step), a re-capture, `release()` while asleep (steps run
eagerly) and a wake-up capture, and a KV cache grown with `resize_kv` (live blocks copied, new
blocks handed out from the grown region), with the same digest as a run without any of it.

    python tools/mini_engine.py --steps 300 --seed 0
    python tools/mini_engine.py --steps 40 --seed 1 --quiet   # the CI run
    python tools/mini_engine.py --steps 60 --seed 1 --recapture-at 20 --recapture-at 41
    python tools/mini_engine.py --steps 60 --seed 1 --lifecycle
    python tools/mini_engine.py --steps 60 --seed 1 --lora
    python tools/mini_engine.py --steps 40 --seed 1 --tp 2 --dp 2   # 4 gloo ranks (tools/_parallel.py)

The parts: `_mini_model.py` (the config, the engine buffers, the model), `_mini_scheduler.py` (requests, the
block allocator, the scheduler, one step checked three ways), `_parallel.py` (`--tp`/`--dp`); this file runs them.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass

import _parallel
import torch
from _mini_model import BUFFERS, CONFIG, LORA, LORA_ADAPTERS, LORA_SLOTS, NUM_ADAPTERS, AdaptedLlama
from _mini_scheduler import BlockPool, MiniEngine, Request

from graphcap import CaptureManager, load_config
from graphcap.models.adapters import adapter_buffers

__all__ = [  # the engine's parts, importable from here as before (tools/_parallel.py, tools/campaign/, tests)
    "BUFFERS",
    "CONFIG",
    "LORA",
    "LORA_ADAPTERS",
    "LORA_SLOTS",
    "NUM_ADAPTERS",
    "AdaptedLlama",
    "BlockPool",
    "MiniEngine",
    "Request",
    "Run",
    "main",
    "run",
]

GROWN_BLOCKS = 60
"""`--lifecycle`: the decoder's KV cache is re-allocated from 30 to this many blocks."""


@dataclass
class Run:
    """What one run of the engine did."""

    engine: MiniEngine
    manager: CaptureManager
    events: list[str]
    """What happened to the graphs and the cache, step by step (`--recapture-at`, `--lifecycle`)."""

    @property
    def digest(self) -> str:
        return self.engine.digest()


def lifecycle_steps(steps: int) -> dict[int, str]:
    """The steps a `--lifecycle` run does each thing before: spread over the run."""
    return {
        steps // 6: "swap",
        steps // 3: "recapture",
        steps // 2: "release",
        steps // 2 + 3: "wake",
        2 * steps // 3: "grow",
    }


def run(
    steps: int, seed: int, *, recapture_at: tuple[int, ...] = (), lifecycle: bool = False, lora: bool = False
) -> Run:
    """The engine for `steps` steps; raises on any disagreement of graph, eager and dense."""
    torch.set_num_threads(1)
    config = load_config(overrides={**CONFIG, **(LORA if lora else {})})
    model = AdaptedLlama(config, lora=lora)
    buffers = [*BUFFERS, *(adapter_buffers(LORA_SLOTS, LORA_ADAPTERS) if lora else ())]
    manager = CaptureManager(model, config, progress=False, buffers=buffers)
    manager.capture()
    engine = MiniEngine(manager, model, seed)
    events: list[str] = []
    plan = lifecycle_steps(steps) if lifecycle else {}
    for index in range(steps):
        live = sum(len(r.blocks) for r in engine.running)
        if index in recapture_at or plan.get(index) == "recapture":
            engine.capture_again()
            events.append(f"step {index}: captured again with {live} live blocks in flight")
        action = plan.get(index)
        if action == "swap":  # an RL weight sync: a new tensor (same values here, so streams compare)
            head = model.llama.lm_head
            model.llama.lm_head = torch.nn.Parameter(head.detach().clone(), requires_grad=False)
        elif action == "release":
            events.append(f"step {index}: released {manager.release()} graphs (asleep: steps run eagerly)")
        elif action == "wake":
            engine.capture_again()
            events.append(f"step {index}: woke, captured {len(manager.graphs)} graphs")
        elif action == "grow":
            engine.grow_kv_cache(GROWN_BLOCKS)
            events.append(
                f"step {index}: KV cache grown to {GROWN_BLOCKS} blocks with {live} live blocks (copied), "
                f"captured again; new blocks come from the grown region"
            )
        engine.step(index)
    events += [
        f"step {i}: the guard refused the replay ({name} was replaced), captured again" for i, name in engine.refused
    ]
    return Run(engine, manager, sorted(events, key=lambda e: int(e.split(":")[0].split()[1])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="engine steps (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts and lengths (default 0)")
    parser.add_argument("--quiet", action="store_true", help="the summary only")
    parser.add_argument(
        "--recapture-at",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="capture again before this step, requests in flight (repeatable)",
    )
    parser.add_argument(
        "--lifecycle",
        action="store_true",
        help="weight swap, re-capture, release and wake, KV cache grown, spread over the run",
    )
    parser.add_argument(
        "--lora", action="store_true", help="LoRA-style adapters in slots, the slot count a key axis (capture.axes)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes; default 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (seeds seed, seed+1, ...)")
    args = parser.parse_args(argv)
    if args.tp not in (1, 2, 4) or args.dp < 1:
        parser.error(f"--tp must be 1, 2 or 4 and --dp >= 1; got --tp {args.tp} --dp {args.dp}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    if args.lifecycle and args.steps < 12:
        parser.error(f"--lifecycle needs --steps >= 12 to spread its events; got {args.steps}")
    for step in args.recapture_at:
        if not 0 <= step < args.steps:
            parser.error(f"--recapture-at must be a step in [0, {args.steps}); got {step}")
    if args.tp > 1 or args.dp > 1:
        if args.recapture_at or args.lifecycle or args.lora:
            parser.error("--recapture-at, --lifecycle and --lora run in one process (without --tp/--dp)")
        return _parallel.run(args)
    result = run(args.steps, args.seed, recapture_at=tuple(args.recapture_at), lifecycle=args.lifecycle, lora=args.lora)
    engine, manager = result.engine, result.manager
    if not args.quiet:
        for event in result.events:
            print(event, file=sys.stderr)
    stats = manager.stats.as_dict()
    replayed = sum(stats["graph_hits"].values())
    eager = Counter(stats["eager"])
    print(f"mini engine: {args.steps} steps, seed {args.seed}")
    print(f"  requests: {engine.num_requests} arrived, {len(engine.finished)} finished, {len(engine.running)} running")
    print(f"  preemptions (recompute): {engine.num_preemptions}")
    print(f"  tokens generated: {sum(len(s) for s in engine.streams.values())}")
    print(
        f"  steps replayed: {replayed}; eager: {sum(eager.values())} ({dict(eager) or 'none'}); "
        f"idle (nothing scheduled): {engine.num_idle_steps}"
    )
    print(f"  padded-token waste of replayed steps: {stats['padded_token_waste']:.1%}")
    if args.lora:
        slots = Counter(dict(key.axes)["lora"] for key in manager.stats.graph_hits.elements())
        print(f"  lora: steps replayed per slot count {dict(sorted(slots.items()))}")
    print("  every step: graph == eager == dense logits, identical token streams")
    if args.lifecycle:
        print(
            f"  lifecycle: {len(engine.refused)} weight swap refused by the guard, {stats['captures']} captures, "
            f"{stats['releases']} releases ({stats['graphs_released']} graphs released), "
            f"KV cache grown to {manager.config.kv_cache.num_blocks} blocks, a second KV group throughout"
        )
    recaptures = f" ({len(args.recapture_at)} re-captures)" if args.recapture_at else ""
    print(f"  token streams digest: {result.digest}{recaptures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
