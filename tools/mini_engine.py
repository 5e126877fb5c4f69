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

A re-capture while requests are in flight (`--recapture-at STEP`, as after a weight swap)
hands graphcap the free blocks as scratch and must leave every live request's KV blocks as
they were: the run then prints the same token-stream digest as a run without it.

    python tools/mini_engine.py --steps 300 --seed 0
    python tools/mini_engine.py --steps 40 --seed 1 --quiet   # the CI run
    python tools/mini_engine.py --steps 60 --seed 1 --recapture-at 20 --recapture-at 41
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

from graphcap import BufferSpec, CaptureManager, StepBatch, load_config
from graphcap.models import TinyLlama, dense_reference

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
}
NUM_ADAPTERS = 3
BUFFERS = [
    # A LoRA-style adapter per token (-1: none) and a temperature per request. Capture's own
    # batches sample real values for both, so verification runs the adapted path too.
    BufferSpec("adapter", "tokens", pad=-1, sample=lambda rng, rows: rng.integers(-1, NUM_ADAPTERS, rows)),
    BufferSpec("temperature", "reqs", dtype="float32", pad=1.0, sample=lambda rng, rows: rng.uniform(0.5, 1.5, rows)),
]


class AdaptedLlama(torch.nn.Module):
    """The engine's model: the reference decoder, a per-adapter logit bias, a per-request temperature.

    `forward` follows graphcap's rules: every per-step value comes from a tensor of `inputs`
    (the adapter and temperature buffers included), padded tokens map to a sink request, and
    nothing is sliced by a Python count.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = TinyLlama(config)
        generator = torch.Generator().manual_seed(config.model.seed + 1)
        bias = torch.randn(NUM_ADAPTERS, config.model.vocab_size, generator=generator)
        self.adapter_bias = torch.nn.Parameter(bias, requires_grad=False)  # [A, vocab]

    def adapt(self, logits: torch.Tensor, adapter: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab], adapter [n] (-1: none), temperature [n] -> adapted logits [n, vocab]."""
        adapter = adapter.long()
        bias = self.adapter_bias.index_select(0, adapter.clamp(min=0)) * (adapter >= 0).unsqueeze(1)
        return (logits + bias) / temperature.unsqueeze(1)

    def forward(self, inputs) -> torch.Tensor:
        logits = self.llama(inputs)  # [T, vocab]
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
        self.free.extend(blocks)  # their stale keys and values stay: the next owner must not read them


class MiniEngine:
    def __init__(self, manager: CaptureManager, model: AdaptedLlama, seed: int, idle_steps: bool = False) -> None:
        self.manager, self.model = manager, model
        self.idle_steps = idle_steps  # a data-parallel rank with nothing scheduled still steps (idle)
        self.config = manager.config
        self.rng = np.random.default_rng(seed)
        self.pool = BlockPool(self.config.kv_cache.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.num_requests = self.num_preemptions = 0
        self.streams: dict[int, list[int]] = {}

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
                picked.append((request, want))
                budget -= want
        return picked

    def preempt(self, keep: set[int]) -> bool:
        """Free the newest running request's blocks (not one scheduled this step); it recomputes later."""
        for victim in reversed(self.running):
            if id(victim) in keep:
                continue
            self.running.remove(victim)
            self.pool.give_back(victim.blocks)
            victim.blocks, victim.computed = [], 0
            victim.preempted += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            return True
        return False

    # -- one step --------------------------------------------------------------------------

    def batch_of(self, picked: list[tuple[Request, int]]) -> StepBatch:
        width = self.config.kv_cache.max_blocks_per_req
        table = np.zeros((len(picked), width), dtype=np.int32)
        ids, adapters = [], []
        for i, (request, q) in enumerate(picked):
            table[i, : len(request.blocks)] = request.blocks
            ids += request.tokens[request.computed : request.computed + q]
            adapters += [request.adapter] * q
        q_lens = [q for _, q in picked]
        seq_lens = [r.computed + q for r, q in picked]
        temperature = np.array([r.temperature for r, _ in picked], dtype=np.float32)
        return StepBatch(q_lens, seq_lens, ids, table, extras={"adapter": adapters, "temperature": temperature})

    def step(self, index: int) -> None:
        self.arrive()
        picked = self.schedule()
        if not picked:
            if self.idle_steps:
                self.manager.execute(None)
            return
        batch = self.batch_of(picked)
        graph = self.manager.execute(batch).clone()  # [n, vocab]; the view is valid until the next step
        eager = self.manager.eager(batch)
        torch.testing.assert_close(graph, eager, msg=lambda m: f"step {index}: graph != eager: {m}")
        dense = self.dense_logits(picked)
        torch.testing.assert_close(
            graph, dense, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {index}: graph != dense: {m}"
        )
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
        for request in [r for r, _ in picked if self.is_done(r)]:
            self.running.remove(request)
            self.pool.give_back(request.blocks)
            request.blocks = []
            self.finished.append(request)

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
        per_request = dense_reference(self.model.llama, [r.tokens[: r.computed + q] for r, q in picked])
        rows = []
        for (request, q), logits in zip(picked, per_request):
            span = logits[request.computed : request.computed + q]  # [q, vocab]
            adapter = torch.full((q,), request.adapter)
            temperature = torch.full((q,), request.temperature)
            rows.append(self.model.adapt(span, adapter, temperature))
        return torch.cat(rows)


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
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes; default 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (seeds seed, seed+1, ...)")
    args = parser.parse_args(argv)
    if args.tp not in (1, 2, 4) or args.dp < 1:
        parser.error(f"--tp must be 1, 2 or 4 and --dp >= 1; got --tp {args.tp} --dp {args.dp}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    for step in args.recapture_at:
        if not 0 <= step < args.steps:
            parser.error(f"--recapture-at must be a step in [0, {args.steps}); got {step}")
    if args.tp > 1 or args.dp > 1:
        if args.recapture_at:
            parser.error("--recapture-at runs in one process (without --tp/--dp)")
        return _parallel.run(args)
    torch.set_num_threads(1)
    config = load_config(overrides=CONFIG)
    model = AdaptedLlama(config)
    manager = CaptureManager(model, config, progress=False, buffers=BUFFERS)
    report = manager.capture()
    if not args.quiet:
        print(f"captured {len(report.captured)} graphs in {report.total_seconds:.2f} s", file=sys.stderr)
    engine = MiniEngine(manager, model, args.seed)
    for index in range(args.steps):
        if index in args.recapture_at:
            live = sum(len(r.blocks) for r in engine.running)
            manager.capture(scratch_blocks=list(engine.pool.free))  # only free blocks may be written
            if not args.quiet:
                print(f"step {index}: captured again with {live} live blocks in flight", file=sys.stderr)
        engine.step(index)
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
    digest = engine.digest()
    recaptures = f" ({len(args.recapture_at)} re-captures)" if args.recapture_at else ""
    print(f"  token streams digest: {digest}{recaptures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
