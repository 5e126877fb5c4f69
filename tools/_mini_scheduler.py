"""mini_engine's engine: requests, the block allocator, the scheduler and one step checked three ways.

What an engine owns, written the plain way: a waiting queue and a running set, a block allocator
that never hands out the null block 0 (freed blocks go back with their stale KV), chunked prefill
under a per-step token budget, decode to a random length, preemption by recompute when blocks run
out, greedy sampling. Every step runs as the graph (`manager.execute`), the same step eagerly
(`manager.eager`) and a dense reference with no cache, paging or padding, and all three must agree.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from _mini_model import LORA_ADAPTERS, LORA_SLOTS, NUM_ADAPTERS, AdaptedLlama

from graphcap import CaptureManager, StaticInputMovedError, StepBatch
from graphcap.capture.verification import assert_close
from graphcap.models import dense_reference, window_reference


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
    lora: int = -1
    """`--lora`: the LoRA adapter the request uses (-1: none)."""
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
        self.lora_rng = np.random.default_rng([seed, 1]) if model.lora is not None else None  # scheduling unchanged
        self.pool = BlockPool(self.config.kv_cache.num_blocks)
        self.window_pool = BlockPool(self.config.kv_cache.groups[0].num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.num_requests = self.num_preemptions = 0
        self.num_idle_steps = 0
        """Steps with nothing to schedule (every request waiting to arrive)."""
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
            if self.lora_rng is not None:
                request.lora = int(self.lora_rng.integers(-1, LORA_ADAPTERS))
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
        axes = None
        if self.lora_rng is not None:  # the step's distinct adapters in slots, each token naming its slot
            used = list(dict.fromkeys(r.lora for r, _ in picked if r.lora >= 0))
            slots = np.full(LORA_SLOTS, -1, dtype=np.int32)
            slots[: len(used)] = used
            extras["lora_table"] = slots
            extras["lora_slot"] = np.repeat([used.index(r.lora) if r.lora >= 0 else -1 for r, _ in picked], q_lens)
            axes = {"lora": len(used)}
        return StepBatch(q_lens, seq_lens, ids, table, extras=extras, kv_groups={"window": window}, axes=axes)

    def step(self, index: int) -> None:
        self.arrive()
        picked = self.schedule()
        if not picked:  # nothing to schedule: no step for this engine (a data-parallel rank still joins its peers)
            self.num_idle_steps += 1
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
            f"replayed ({self.num_idle_steps} of them idle: nothing scheduled, the agreed graph run with no real "
            f"rows), {sum(stats['eager'].values())} eager"
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
            if self.model.lora is not None:
                span = span + self.model.lora.reference(
                    request.tokens[request.computed : request.computed + q], request.lora
                )
            adapter = torch.full((q,), request.adapter)
            temperature = torch.full((q,), request.temperature)
            rows.append(self.model.adapt(span, adapter, temperature))
        return torch.cat(rows)
