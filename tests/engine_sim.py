"""A small scheduler for tests: requests join, prefill in chunks, decode, cross blocks, finish.

It owns a block allocator that never hands out the null block 0, and builds real
`StepBatch`es (token ids, seq_lens, block tables) the way an engine would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcap import StepBatch


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    computed: int = 0
    generated: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block

    def grow(self, request: Request, length: int, block_size: int) -> None:
        while len(request.blocks) * block_size < length:
            request.blocks.append(self.free.pop())

    def release(self, request: Request) -> None:
        self.free.extend(request.blocks)
        request.blocks.clear()


class Scheduler:
    """Each step: running requests decode one token (or `q` in spec mode), new ones prefill a chunk."""

    def __init__(self, config, rng: np.random.Generator, *, chunk: int = 16, spec_len: int = 1) -> None:
        self.config = config
        self.rng = rng
        self.chunk = chunk
        self.spec_len = spec_len
        self.block_size = config.kv_cache.block_size
        self.allocator = BlockAllocator(config.kv_cache.num_blocks)
        self.running: list[Request] = []
        self.finished: list[Request] = []

    def add(self, prompt_len: int, max_new_tokens: int) -> Request:
        vocab = self.config.model.vocab_size
        request = Request(self.rng.integers(0, vocab, prompt_len).tolist(), max_new_tokens)
        self.running.append(request)
        return request

    def next_batch(self, max_tokens: int | None = None) -> tuple[StepBatch, list[Request], list[int]]:
        """The next step: (batch, its requests, query lengths)."""
        max_tokens = max_tokens or self.config.batching.max_num_tokens
        picked, q_lens, budget = [], [], max_tokens
        for request in self.running[: self.config.batching.max_num_seqs]:
            remaining = len(request.tokens) - request.computed
            want = min(self.chunk, remaining) if remaining > 1 else self.spec_len
            want = min(want, budget, self.config.kv_cache.max_model_len - request.computed)
            if want <= 0:
                continue
            picked.append(request)
            q_lens.append(want)
            budget -= want
        ids, seq_lens, width = [], [], self.config.kv_cache.max_blocks_per_req
        table = np.zeros((len(picked), width), dtype=np.int32)
        for i, (request, q) in enumerate(zip(picked, q_lens)):
            tokens = request.tokens
            # spec-decode steps verify q tokens past what is known: pad with draft ids
            while len(tokens) < request.computed + q:
                tokens = [*tokens, int(self.rng.integers(0, self.config.model.vocab_size))]
            ids += tokens[request.computed : request.computed + q]
            seq_lens.append(request.computed + q)
            self.allocator.grow(request, request.computed + q, self.block_size)
            table[i, : len(request.blocks)] = request.blocks
        return StepBatch(q_lens, seq_lens, input_ids=ids, block_table=table), picked, q_lens

    def advance(self, picked: list[Request], q_lens: list[int], logits) -> None:
        """Commit the step: greedy-sample a token for requests that reached the end."""
        offsets = np.cumsum([0, *q_lens])
        for request, q, end in zip(picked, q_lens, offsets[1:]):
            request.computed += q
            if request.computed >= len(request.tokens):
                request.computed = len(request.tokens)
                request.generated.append(int(logits[end - 1].argmax()))
        for request in [r for r in self.running if r.done or len(r.tokens) >= self.config.kv_cache.max_model_len]:
            self.running.remove(request)
            self.allocator.release(request)
            self.finished.append(request)
