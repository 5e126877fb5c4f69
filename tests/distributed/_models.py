"""Small models with collectives inside their forward, for the multi-rank tests (emulated backend, gloo).

`TensorParallelMLP`: embedding -> column-parallel W1 -> relu -> row-parallel W2 -> all-reduce ->
residual -> head, written with each all-reduce spelling a model may use; `reference` is the
same network with full weights in one process. `GatherMLP`: a data-parallel all-gather inside
the forward (what DP attention and expert parallelism do), which also copies the per-rank token
counts graphcap stages into a buffer the test reads.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

import graphcap

VOCAB, HIDDEN, FFN = 128, 32, 64
CONFIG = {
    "device": "cpu",
    "model.vocab_size": VOCAB,
    "batching.max_num_seqs": 8,
    "batching.max_num_tokens": 32,
    "kv_cache.block_size": 8,
    "kv_cache.num_blocks": 32,
    "kv_cache.max_model_len": 64,
    "capture.sizes": [1, 2, 4, 8],
    "capture.num_warmups": 1,
}
"""Sizes 1, 2, 4, 8 (uniform and mixed keys: 8 graphs); steps above 8 tokens run eagerly."""


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(VOCAB, HIDDEN, generator=g) * 0.5,
        "w1": torch.randn(HIDDEN, FFN, generator=g) * 0.2,
        "w2": torch.randn(FFN, HIDDEN, generator=g) * 0.2,
        "head": torch.randn(HIDDEN, VOCAB, generator=g) * 0.2,
    }


def reference(input_ids) -> torch.Tensor:
    """The full network in one process: [n] token ids -> logits [n, VOCAB]."""
    w = _weights()
    x = w["emb"][torch.as_tensor(np.asarray(input_ids), dtype=torch.long)]
    return (x + torch.relu(x @ w["w1"]) @ w["w2"]) @ w["head"]


class CustomAllReduce:
    """vLLM's and SGLang's custom all-reduce: inside its `capture()` (the engine's capture context) a
    run that is not being recorded is a warmup and returns `zeros_like`. `ask="graphcap"` learns
    that from `graphcap.is_capturing()`; `ask="cuda"` from torch's stream query where CUDA is available
    (never on a CPU); `ask="stream"` asks `torch.cuda.is_current_stream_capturing()` as vLLM does
    (`stream_capturing`)."""

    def __init__(self, group, ask: str) -> None:
        self.group, self.ask = group, ask
        self.in_capture = False
        self.placeholders = 0

    @contextlib.contextmanager
    def capture(self):
        self.in_capture = True
        try:
            yield
        finally:
            self.in_capture = False

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.in_capture:
            if self.ask == "graphcap":
                recording = graphcap.is_capturing()
            elif self.ask == "stream":
                recording = stream_capturing()
            else:
                recording = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if not recording:
                self.placeholders += 1
                return torch.zeros_like(y)
        return self.reduce(y)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.ops._c10d_functional.all_reduce(y, "sum", self.group.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)


def stream_capturing() -> bool:
    """`torch.cuda.is_current_stream_capturing()`; False where torch has no CUDA runtime to ask (a CPU build
    raises there), which is CUDA's answer on a stream that is not capturing."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


class TensorParallelMLP(torch.nn.Module):
    """One shard (`rank` of `world`) of the reference network; `spelling` picks the all-reduce:
    `functional` (torch.ops._c10d_functional + wait_tensor), `funcol` (_functional_collectives),
    `inplace` (dist.all_reduce), `custom_graphcap` / `custom_cuda` / `custom_stream` (`CustomAllReduce`)."""

    def __init__(self, rank: int, world: int, spelling: str, group) -> None:
        super().__init__()
        w = _weights()
        shard = FFN // world
        cols = slice(rank * shard, (rank + 1) * shard)
        self.emb = torch.nn.Parameter(w["emb"], requires_grad=False)
        self.w1 = torch.nn.Parameter(w["w1"][:, cols].clone(), requires_grad=False)
        self.w2 = torch.nn.Parameter(w["w2"][cols].clone(), requires_grad=False)
        self.head = torch.nn.Parameter(w["head"], requires_grad=False)
        self.spelling, self.group = spelling, group
        self.custom = (
            CustomAllReduce(group, spelling.removeprefix("custom_")) if spelling.startswith("custom") else None
        )

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.spelling == "functional":
            out = torch.ops._c10d_functional.all_reduce(y, "sum", self.group.group_name)
            return torch.ops._c10d_functional.wait_tensor(out)
        if self.spelling == "funcol":
            import torch.distributed._functional_collectives as funcol

            return funcol.all_reduce(y, "sum", self.group)
        if self.spelling == "inplace":
            import torch.distributed as dist

            dist.all_reduce(y, group=self.group)  # in place: the emulated backend refuses it
            return y
        return self.custom.all_reduce(y)

    def forward(self, inputs) -> torch.Tensor:
        x = self.emb[inputs.input_ids.long()]
        return (x + self.all_reduce(torch.relu(x @ self.w1) @ self.w2)) @ self.head


class GatherMLP(torch.nn.Module):
    """The reference network (no tensor parallelism) plus a data-parallel all-gather of a [T, 1]
    slice, and a copy of `inputs.extras["num_tokens_across_dp"]` into `seen` (a persistent buffer the
    graph writes in place on every replay). `on_prepare(inputs)`, when set, runs in `prepare` (after
    the agreement of a step: tests refuse or kill a rank there)."""

    def __init__(self, group, world: int) -> None:
        super().__init__()
        w = _weights()
        for name, value in w.items():
            setattr(self, name, torch.nn.Parameter(value, requires_grad=False))
        self.register_buffer("seen", torch.zeros(world, dtype=torch.int32))
        self.group_name, self.world = group.group_name, world
        self.on_prepare = None

    def prepare(self, inputs, phase) -> None:
        if self.on_prepare is not None:
            self.on_prepare(inputs)

    def forward(self, inputs) -> torch.Tensor:
        x = self.emb[inputs.input_ids.long()]
        logits = (x + torch.relu(x @ self.w1) @ self.w2) @ self.head
        counts = inputs.extras.get("num_tokens_across_dp")
        if counts is not None:
            self.seen.copy_(counts)
        part = logits[:, :1].contiguous()
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(part, self.world, self.group_name)
        gathered = torch.ops._c10d_functional.wait_tensor(gathered)
        return logits + 0.0 * gathered.sum()


def decodes(num_tokens: int, seed: int = 0, bad_block: bool = False):
    """A `StepBatch` of `num_tokens` decodes (one prefill chunk of `num_tokens` above 8), or None for 0."""
    from graphcap import StepBatch

    if num_tokens == 0:
        return None
    rng = np.random.default_rng(seed)
    q = np.ones(num_tokens, np.int32) if num_tokens <= 8 else np.array([num_tokens], np.int32)
    s = q + rng.integers(0, 20, len(q)).astype(np.int32)
    width = int(-(-s.max() // 8))
    table = np.arange(1, 1 + len(q) * width, dtype=np.int32).reshape(len(q), width) % 30 + 1
    if bad_block:
        table[0, 0] = 999  # outside kv_cache.num_blocks: staging refuses the batch
    return StepBatch(q, s, rng.integers(0, VOCAB, int(q.sum())).astype(np.int32), table)


def tape_ops(graph) -> list[str]:
    """The op names on an emulated graph's tape ("_c10d_functional::all_reduce", ...)."""
    names = []
    for step in graph.tape.steps:
        op = step[0]
        names.append(str(getattr(op, "_name", None) or getattr(op, "__qualname__", None) or op))
    return names
