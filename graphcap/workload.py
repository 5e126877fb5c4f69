"""Random engine-like step sequences for `graphcap verify`, benchmarks and stress tests.

`Workload` plays a small scheduler: requests join with prompts of different lengths,
prefill in chunks, decode (or verify `q` draft tokens per step for speculative decoding),
grow across KV-cache blocks and finish. Blocks come from an allocator that never hands
out the null block 0. Batches are real `StepBatch`es with token ids and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcap.batch import StepBatch, dummy_batch
from graphcap.config import CaptureConfig
from graphcap.keys import GraphKey, KeyRegistry
from graphcap.probe import distinct_blocks

__all__ = ["Request", "Workload", "fill_batch"]


def fill_batch(
    key: GraphKey, config: CaptureConfig, rng: np.random.Generator | int = 0, num_reqs: int | None = None
) -> StepBatch:
    """A real batch for `key` with `num_reqs` requests (None: the dummy batch's layout, which
    fills the key), random context lengths, token ids and distinct blocks per request (never the
    null block 0), so that no two tokens write one KV slot.

    Uniform keys get `T / R` tokens per request; mixed keys spread up to `T` tokens over the
    requests at random. `num_reqs=0` is the empty batch. The batch states the key's axis values.
    """
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    kv = config.kv_cache
    if key.num_reqs is None:  # a piecewise key: its tokens over as many requests as its capture batches
        key = KeyRegistry.from_config(config).capture_shape(key)
    if num_reqs is None:
        q = dummy_batch(key, max_model_len=kv.max_model_len).query_lens.astype(np.int64)
    elif num_reqs == 0:
        return StepBatch([], [])
    elif key.uniform and key.num_reqs is not None:  # a capture shape: its rows are set
        q = np.full(num_reqs, key.num_tokens // key.num_reqs, dtype=np.int64)
    else:
        q = np.ones(num_reqs, dtype=np.int64)
        extra = int(rng.integers(0, key.num_tokens - num_reqs + 1))
        np.add.at(q, rng.integers(0, num_reqs, extra), 1)
        q = np.minimum(q, kv.max_model_len)
    context = rng.integers(0, np.maximum(1, kv.max_model_len - q + 1))
    if (-(-(context + q) // kv.block_size)).sum() > kv.num_blocks - 1:  # keep blocks distinct where possible
        context = np.minimum(context, kv.block_size)
    blocks = distinct_blocks(q + context, kv.block_size, kv.num_blocks, rng)
    ids = rng.integers(0, config.model.vocab_size, int(q.sum()))
    return StepBatch(q, q + context, ids, blocks, axes=dict(key.axes))  # at the key's axis values (capture.axes)


@dataclass
class Request:
    """One request of the workload: its token ids, how many are in the KV cache, its blocks."""

    tokens: list[int]
    max_new_tokens: int
    computed: int = 0
    """Tokens already written to the KV cache."""
    num_generated: int = 0
    blocks: list[int] = field(default_factory=list)


class Workload:
    """A seeded stream of steps. Call `next_batch()`, run it, then `advance(logits)`.

    `spec_len > 1` makes every decode step verify `spec_len` tokens (uniform batches of
    `spec_len` tokens per request when no request is prefilling).
    """

    def __init__(self, config: CaptureConfig, seed: int = 0, *, chunk: int = 32, spec_len: int = 1) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.chunk = chunk
        self.spec_len = spec_len
        self.block_size = config.kv_cache.block_size
        self._free = list(range(config.kv_cache.num_blocks - 1, 0, -1))  # block 0 is the null block
        self.running: list[Request] = []
        self.num_finished = 0
        self._last: tuple[list[Request], list[int]] = ([], [])

    def add(self, prompt_len: int, max_new_tokens: int) -> Request:
        """A new request with `prompt_len` random token ids."""
        ids = self.rng.integers(0, self.config.model.vocab_size, prompt_len).tolist()
        request = Request(ids, max_new_tokens)
        self.running.append(request)
        return request

    def add_random(self, max_prompt_len: int = 64) -> Request:
        limit = min(max_prompt_len, self.config.kv_cache.max_model_len // 2)
        return self.add(int(self.rng.integers(1, limit + 1)), int(self.rng.integers(1, 40)))

    def next_batch(self, max_tokens: int | None = None) -> StepBatch:
        """The next step over the running requests, within the token and request budgets."""
        config = self.config
        budget = max_tokens or config.batching.max_num_tokens
        max_len = config.kv_cache.max_model_len
        picked, q_lens = [], []
        for request in self.running[: config.batching.max_num_seqs]:
            pending = len(request.tokens) - request.computed
            want = min(self.chunk, pending) if pending > 1 else self.spec_len
            want = min(want, budget, max_len - request.computed)
            needed = -(-(request.computed + want) // self.block_size) - len(request.blocks)
            if want <= 0 or needed > len(self._free):
                continue
            picked.append(request)
            q_lens.append(want)
            budget -= want
            request.blocks += [self._free.pop() for _ in range(max(0, needed))]
        ids: list[int] = []
        table = np.zeros((len(picked), config.kv_cache.max_blocks_per_req), dtype=np.int32)
        for i, (request, q) in enumerate(zip(picked, q_lens)):
            step = request.tokens[request.computed : request.computed + q]
            # Speculative decoding verifies draft tokens beyond the known ones.
            step += self.rng.integers(0, config.model.vocab_size, q - len(step)).tolist()
            ids += step
            table[i, : len(request.blocks)] = request.blocks
        seq_lens = [r.computed + q for r, q in zip(picked, q_lens)]
        self._last = (picked, q_lens)
        return StepBatch(q_lens, seq_lens, input_ids=ids, block_table=table)

    def advance(self, logits) -> None:
        """Commit the last batch: greedy-sample one token per request that reached its end."""
        picked, q_lens = self._last
        end = 0
        for request, q in zip(picked, q_lens):
            end += q
            request.computed = min(request.computed + q, len(request.tokens))
            if request.computed == len(request.tokens):
                request.tokens.append(int(logits[end - 1].argmax()))
                request.num_generated += 1
        max_len = self.config.kv_cache.max_model_len
        for request in [r for r in self.running if r.num_generated >= r.max_new_tokens or len(r.tokens) >= max_len]:
            self.running.remove(request)
            self._free += request.blocks
            request.blocks = []
            self.num_finished += 1
        self._last = ([], [])
