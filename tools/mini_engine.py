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
`--lifecycle` runs an engine's whole life on the way: a weight swap the guard refuses (the
engine re-captures and retries the step), a re-capture, `release()` while asleep (steps run
eagerly) and a wake-up capture, and a KV cache grown with `resize_kv` (live blocks copied, new
blocks handed out from the grown region), with the same digest as a run without any of it.

    python tools/mini_engine.py --steps 300 --seed 0
    python tools/mini_engine.py --steps 40 --seed 1 --quiet   # the CI run
    python tools/mini_engine.py --steps 60 --seed 1 --recapture-at 20 --recapture-at 41
    python tools/mini_engine.py --steps 60 --seed 1 --lifecycle
    python tools/mini_engine.py --steps 40 --seed 1 --tp 2 --dp 2   # 4 gloo ranks (tools/_parallel.py)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter, deque
from dataclasses import dataclass, field

import _parallel
import numpy as np
import torch

from graphcap import BufferSpec, CaptureManager, StaticInputMovedError, StepBatch, load_config
from graphcap.capture.verification import assert_close
from graphcap.models import TinyLlama, WindowedMemory, dense_reference, window_reference

CONFIG = {
    "device": "cpu",
    "model.hidden_size": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.vocab_size": 256,
    "batching.max_num_seqs": 8,
    "batching.max_num_tokens": 48,
    "kv_cache.block_size": 4,
    "kv_cache.num_blocks": 30,  # few blocks: requests wait, get preempted and reuse stale blocks
    "kv_cache.max_model_len": 48,
    "capture.sizes": [1, 2, 4, 8, 16, 24, 32],
    "checks.invariants": "full",
    # The sliding-window memory's group: 2-token blocks, a 6-token window, enough blocks for every
    # request's window and its largest chunk (its allocator never runs out).
    "kv_cache.groups": [{"name": "window", "block_size": 2, "num_blocks": 96, "sliding_window": 6}],
}
GROWN_BLOCKS = 60
"""`--lifecycle`: the decoder's KV cache is re-allocated from 30 to this many blocks."""
NUM_ADAPTERS = 3
BUFFERS = [
    # A LoRA-style adapter per token (-1: none) and a temperature per request. Capture's own
    # batches sample real values for both, so verification runs the adapted path too.
    BufferSpec("adapter", "tokens", pad=-1, sample=lambda rng, rows: rng.integers(-1, NUM_ADAPTERS, rows)),
    BufferSpec("temperature", "reqs", dtype="float32", pad=1.0, sample=lambda rng, rows: rng.uniform(0.5, 1.5, rows)),
]


class AdaptedLlama(torch.nn.Module):
    """The engine's model: the reference decoder plus a sliding-window memory on a second KV-cache
    group, a per-adapter logit bias, a per-request temperature.

    `forward` follows graphcap's rules: every per-step value comes from a tensor of `inputs`
    (the adapter and temperature buffers included), padded tokens map to a sink request, and
    nothing is sliced by a Python count.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = TinyLlama(config)
        self.memory = WindowedMemory(config, "window")
        generator = torch.Generator().manual_seed(config.model.seed + 1)
        bias = torch.randn(NUM_ADAPTERS, config.model.vocab_size, generator=generator)
        self.adapter_bias = torch.nn.Parameter(bias, requires_grad=False)  # [A, vocab]

    def adapt(self, logits: torch.Tensor, adapter: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab], adapter [n] (-1: none), temperature [n] -> adapted logits [n, vocab]."""
        adapter = adapter.long()
        bias = self.adapter_bias.index_select(0, adapter.clamp(min=0)) * (adapter >= 0).unsqueeze(1)
        return (logits + bias) / temperature.unsqueeze(1)

    def forward(self, inputs) -> torch.Tensor:
        logits = self.llama(inputs) + self.memory(inputs)  # [T, vocab]
        qsl, T, R = inputs.query_start_loc, inputs.input_ids.shape[0], inputs.seq_lens.shape[0]
        repeats = torch.cat((qsl.diff(), T - qsl[R:]))  # request R: the sink of padded tokens
        req = torch.repeat_interleave(torch.arange(R + 1, device=qsl.device), repeats, output_size=T)
        temperature = torch.cat((inputs.extras["temperature"], inputs.extras["temperature"].new_ones(1)))
        return self.adapt(logits, inputs.extras["adapter"], temperature.index_select(0, req))


@dataclass
class Request:
    id: int
    tokens: list[int]
    """Prompt and generated tokens so far."""
    max_new_tokens: int
    adapter: int
    temperature: float
    num_generated: int = 0
    computed: int = 0
    """Tokens whose keys and values are in the KV cache."""
    blocks: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(default_factory=list)
    """The window group's blocks by column; 0 (the null block) where the window has passed."""
    preempted: int = 0


class BlockPool:
    """Free KV-cache blocks. Block 0 is the null block graphcap pads with: never handed out."""

    def __init__(self, num_blocks: int) -> None:
        self.free = deque(range(1, num_blocks))

    def take(self, count: int) -> list[int] | None:
        if count > len(self.free):
            return None
        return [self.free.popleft() for _ in range(count)]

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(b for b in blocks if b)  # stale keys and values stay: the next owner must not read them


class MiniEngine:
    def __init__(self, manager: CaptureManager, model: AdaptedLlama, seed: int, idle_steps: bool = False) -> None:
        self.manager, self.model = manager, model
        self.idle_steps = idle_steps  # a data-parallel rank with nothing scheduled still steps (idle)
        self.config = manager.config
        self.rng = np.random.default_rng(seed)
        self.pool = BlockPool(self.config.kv_cache.num_blocks)
        self.window_pool = BlockPool(self.config.kv_cache.groups[0].num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.num_requests = self.num_preemptions = 0
        self.streams: dict[int, list[int]] = {}
        self.refused: list[tuple[int, str]] = []
        """(step, static input) of every replay the guard refused."""

    # -- requests arrive -------------------------------------------------------------------

    def arrive(self) -> None:
        rng = self.rng
        for _ in range(int(rng.poisson(0.6))):
            prompt = rng.integers(0, self.config.model.vocab_size, int(rng.integers(1, 20))).tolist()
            request = Request(
                self.num_requests,
                prompt,
                max_new_tokens=int(rng.integers(1, 16)),
                adapter=int(rng.integers(-1, NUM_ADAPTERS)),
                temperature=float(rng.uniform(0.5, 1.5)),
            )
            self.num_requests += 1
            self.waiting.append(request)

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's requests and their query lengths, within the token budget."""
        kv, batching = self.config.kv_cache, self.config.batching
        budget = int(self.rng.integers(1, batching.max_num_tokens + 1))
        while self.waiting and len(self.running) < batching.max_num_seqs:
            self.running.append(self.waiting.popleft())
        picked: list[tuple[Request, int]] = []
        for request in list(self.running):
            if budget == 0 or len(picked) == batching.max_num_seqs:
                break
            if request not in self.running:  # preempted while making room for an earlier one
                continue
            pending = len(request.tokens) - request.computed
            want = min(pending, budget, 12)  # chunked prefill; a decode step has pending == 1
            need = -(-(request.computed + want) // kv.block_size) - len(request.blocks)
            while need > 0 and (blocks := self.pool.take(need)) is None:
                if not self.preempt(keep={id(request), *(id(r) for r, _ in picked)}):
                    break
            else:
                if need > 0:
                    request.blocks += blocks
                self.grow_window(request, request.computed + want)
                picked.append((request, want))
                budget -= want
        return picked

    def grow_window(self, request: Request, length: int) -> None:
        """The window group's blocks for `length` tokens (its pool holds every window: never short)."""
        size = self.config.kv_cache.groups[0].block_size
        need = -(-length // size) - len(request.window_blocks)
        if need > 0:
            blocks = self.window_pool.take(need)
            if blocks is None:
                raise RuntimeError("the window group's pool ran out: raise its num_blocks")
            request.window_blocks += blocks

    def slide_window(self, request: Request) -> None:
        """Blocks wholly before the next token's window go back to the pool; their columns to the null block."""
        group = self.config.kv_cache.groups[0]
        first_read = request.computed - group.sliding_window + 1  # the next token reads from here on
        for column in range(max(0, first_read) // group.block_size):
            if request.window_blocks[column]:
                self.window_pool.give_back([request.window_blocks[column]])
                request.window_blocks[column] = 0

    def free(self, request: Request) -> None:
        self.pool.give_back(request.blocks)
        self.window_pool.give_back(request.window_blocks)
        request.blocks, request.window_blocks = [], []

    def preempt(self, keep: set[int]) -> bool:
        """Free the newest running request's blocks (not one scheduled this step); it recomputes later."""
        for victim in reversed(self.running):
            if id(victim) in keep:
                continue
            self.running.remove(victim)
            self.free(victim)
            victim.computed = 0
            victim.preempted += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            return True
        return False

    # -- one step --------------------------------------------------------------------------

    def batch_of(self, picked: list[tuple[Request, int]]) -> StepBatch:
        kv = self.config.kv_cache
        table = np.zeros((len(picked), kv.max_blocks_per_req), dtype=np.int32)
        window = np.zeros((len(picked), kv.groups[0].max_blocks_per_req(kv.max_model_len)), dtype=np.int32)
        ids, adapters = [], []
        for i, (request, q) in enumerate(picked):
            table[i, : len(request.blocks)] = request.blocks
            window[i, : len(request.window_blocks)] = request.window_blocks
            ids += request.tokens[request.computed : request.computed + q]
            adapters += [request.adapter] * q
        q_lens = [q for _, q in picked]
        seq_lens = [r.computed + q for r, q in picked]
        temperature = np.array([r.temperature for r, _ in picked], dtype=np.float32)
        extras = {"adapter": adapters, "temperature": temperature}
        return StepBatch(q_lens, seq_lens, ids, table, extras=extras, kv_groups={"window": window})

    def step(self, index: int) -> None:
        self.arrive()
        picked = self.schedule()
        if not picked:
            if self.idle_steps:
                self.manager.execute(None)
            return
        batch = self.batch_of(picked)
        try:
            graph = self.manager.execute(batch).clone()  # [n, vocab]; the view is valid until the next step
        except StaticInputMovedError as exc:  # weights swapped since capture: capture again, then retry
            self.refused.append((index, exc.input_name))
            self.capture_again()
            graph = self.manager.execute(batch).clone()
        eager = self.manager.eager(batch)
        assert_close(graph, eager, msg=lambda m: f"step {index}: graph != eager: {m}")
        dense = self.dense_logits(picked)
        assert_close(graph, dense, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {index}: graph != dense: {m}")
        end = 0
        for request, q in picked:
            end += q
            request.computed += q
            if request.computed == len(request.tokens):  # the prefill is done: sample one token
                token = int(graph[end - 1].argmax())
                for name, logits in (("eager", eager), ("dense", dense)):
                    if int(logits[end - 1].argmax()) != token:
                        raise AssertionError(f"step {index}: request {request.id}: {name} samples another token")
                request.tokens.append(token)
                request.num_generated += 1
                self.streams.setdefault(request.id, []).append(token)
        for request, _ in picked:
            self.slide_window(request)
        for request in [r for r, _ in picked if self.is_done(r)]:
            self.running.remove(request)
            self.free(request)
            self.finished.append(request)

    def capture_again(self) -> None:
        """Capture with requests in flight: only free blocks of each group may be written."""
        self.manager.capture(
            scratch_blocks=list(self.pool.free), group_scratch_blocks={"window": list(self.window_pool.free)}
        )

    def grow_kv_cache(self, num_blocks: int) -> None:
        """Re-allocate the decoder's cache (live blocks copied), tell graphcap, capture again.

        The pool then hands out blocks of the grown region: as many as were free, so scheduling
        (and every token stream) stays that of a run without the resize.
        """
        old = self.config.kv_cache.num_blocks
        self.model.llama.resize_kv_cache(num_blocks)
        self.manager.resize_kv(num_blocks)
        self.config = self.manager.config
        count = len(self.pool.free)
        if count > num_blocks - old:
            raise RuntimeError(f"grow the cache by at least {count} blocks")
        self.pool.free = deque(range(old, old + count))
        self.capture_again()

    def digest(self) -> str:
        """16 hex digits of the token streams: equal runs, equal digests."""
        return hashlib.sha256(repr(sorted(self.streams.items())).encode()).hexdigest()[:16]

    def summary(self) -> str:
        stats = self.manager.stats.as_dict()
        return (
            f"{self.num_requests} requests, {len(self.finished)} finished, "
            f"{sum(len(s) for s in self.streams.values())} tokens, {sum(stats['graph_hits'].values())} steps "
            f"replayed, {sum(stats['eager'].values())} eager"
        )

    def is_done(self, request: Request) -> bool:
        full = len(request.tokens) >= self.config.kv_cache.max_model_len
        return request.num_generated >= request.max_new_tokens or full

    def dense_logits(self, picked: list[tuple[Request, int]]) -> torch.Tensor:
        """This step's rows recomputed per request from all its tokens: no cache, paging or padding."""
        tokens = [r.tokens[: r.computed + q] for r, q in picked]
        bias = window_reference(self.model.memory, tokens)
        per_request = [d + w for d, w in zip(dense_reference(self.model.llama, tokens), bias)]
        rows = []
        for (request, q), logits in zip(picked, per_request):
            span = logits[request.computed : request.computed + q]  # [q, vocab]
            adapter = torch.full((q,), request.adapter)
            temperature = torch.full((q,), request.temperature)
            rows.append(self.model.adapt(span, adapter, temperature))
        return torch.cat(rows)


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


def run(steps: int, seed: int, *, recapture_at: tuple[int, ...] = (), lifecycle: bool = False) -> Run:
    """The engine for `steps` steps; raises on any disagreement of graph, eager and dense."""
    torch.set_num_threads(1)
    config = load_config(overrides=CONFIG)
    model = AdaptedLlama(config)
    manager = CaptureManager(model, config, progress=False, buffers=BUFFERS)
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
        if args.recapture_at or args.lifecycle:
            parser.error("--recapture-at and --lifecycle run in one process (without --tp/--dp)")
        return _parallel.run(args)
    result = run(args.steps, args.seed, recapture_at=tuple(args.recapture_at), lifecycle=args.lifecycle)
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
    print(f"  steps replayed: {replayed}; eager: {sum(eager.values())} ({dict(eager) or 'none'})")
    print(f"  padded-token waste of replayed steps: {stats['padded_token_waste']:.1%}")
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
