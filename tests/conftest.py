"""Shared fixtures and hypothesis strategies: a small buffer geometry and valid batches for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from graphcap.batch import StepBatch
from graphcap.config import PadRules
from graphcap.keys import GraphKey
from graphcap.staging import PersistentBuffers

ASSETS = Path(__file__).parent / "assets"

torch.set_num_threads(1)  # the test processes share few cores (pytest -n 2 on two): one torch thread each

# Small enough that hypothesis explores the corners, big enough for padded tails.
BLOCK_SIZE = 4
MAX_REQS = 8
MAX_TOKENS = 32
MAX_BLOCKS = 6
MAX_MODEL_LEN = MAX_BLOCKS * BLOCK_SIZE
NUM_BLOCKS = 64  # every request of a full batch gets its own blocks: 8 x 6 < 63
VOCAB = 50

PAD_RULES = {
    "default": PadRules(),
    "sglang": PadRules(query_len=1, seq_len=1),
    "odd": PadRules(query_len=2, seq_len=3, slot=-7, position=5, token_id=9, block_id=3),
}


def make_buffers(pad_rules: PadRules | None = None, *, poison: bool = False) -> PersistentBuffers:
    return PersistentBuffers(
        MAX_REQS,
        MAX_TOKENS,
        MAX_BLOCKS,
        "cpu",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        vocab_size=VOCAB,
        max_model_len=MAX_MODEL_LEN,
        pad_rules=pad_rules,
        poison=poison,
    )


@pytest.fixture
def buffers() -> PersistentBuffers:
    return make_buffers()


@st.composite
def step_batches(draw, *, uniform_query_len: int | None = None, max_tokens: int = MAX_TOKENS) -> StepBatch:
    """Any batch valid for `make_buffers()`: lists or numpy int32/int64, ids and blocks optional."""
    num_reqs = draw(st.integers(0, min(MAX_REQS, max_tokens // (uniform_query_len or 1))))
    query_lens, budget = [], max_tokens
    for _ in range(num_reqs):
        q = uniform_query_len or draw(st.integers(1, max(1, min(12, budget - (num_reqs - len(query_lens) - 1)))))
        query_lens.append(q)
        budget -= q
    seq_lens = [q + draw(st.integers(0, MAX_MODEL_LEN - q)) for q in query_lens]
    num_tokens = sum(query_lens)
    input_ids = draw(st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=num_tokens, max_size=num_tokens))
    block_table = None
    if draw(st.booleans()):
        # Every request its own blocks (never the null block): no two tokens write one KV slot.
        need = max((-(-s // BLOCK_SIZE) for s in seq_lens), default=0)
        width = draw(st.integers(need, MAX_BLOCKS))
        blocks = draw(st.permutations(range(1, NUM_BLOCKS)))
        block_table = [blocks[i * width : (i + 1) * width] for i in range(num_reqs)]
    dtype = draw(st.sampled_from([None, np.int32, np.int64]))
    if dtype is not None:
        query_lens, seq_lens = np.array(query_lens, dtype), np.array(seq_lens, dtype)
        if input_ids is not None:
            input_ids = np.array(input_ids, dtype)
        if block_table is not None:
            block_table = np.array(block_table, dtype).reshape(num_reqs, width)
    return StepBatch(query_lens, seq_lens, input_ids, block_table)


@st.composite
def batches_and_keys(draw, *, uniform_query_len: int | None = None) -> tuple[StepBatch, GraphKey]:
    """A valid batch and any key that holds it: mixed, or uniform when the batch is."""
    batch = draw(step_batches(uniform_query_len=uniform_query_len))
    q = batch.max_query_len
    if batch.num_reqs and batch.is_uniform(q) and draw(st.booleans()):
        num_reqs = draw(st.integers(batch.num_reqs, min(MAX_REQS, MAX_TOKENS // q)))
        return batch, GraphKey(num_reqs * q, num_reqs, True)
    num_tokens = draw(st.integers(max(batch.num_tokens, 1), MAX_TOKENS))
    num_reqs = draw(st.integers(max(batch.num_reqs, 1), MAX_REQS))
    return batch, GraphKey(num_tokens, num_reqs, False)


_SLOW_FIRST = ("tests/tools/", "tests/distributed/", "tests/cli/", "tests/reliability/")
"""Folders whose tests start processes (tools, ranks, the command line) or run long campaigns."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the folders of long tests first (stable within each), so that with `-n 2` the workers
    start on them and the short tests fill in, instead of one worker finishing a long test alone
    at the end. No test depends on the order: each writes under its own `tmp_path`."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.replace("\\", "/")
        return next((i for i, folder in enumerate(_SLOW_FIRST) if path.startswith(folder)), len(_SLOW_FIRST))

    items.sort(key=rank)
