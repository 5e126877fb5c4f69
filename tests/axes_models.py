"""A model with a key axis for the axis tests: the reference decoder plus LoRA-style adapter slots."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from graphcap import StepBatch
from graphcap.models import TinyLlama
from graphcap.models.adapters import AdapterSlots, adapter_buffers

MAX_SLOTS = 8
NUM_ADAPTERS = 6
AXES = {"lora": [0, 1, 2, 4]}


class SlotLlama(torch.nn.Module):
    """TinyLlama's logits plus `AdapterSlots`' deltas (`neutral=False`: empty slots leak into every token)."""

    def __init__(self, config, *, neutral: bool = True) -> None:
        super().__init__()
        self.llama = TinyLlama(config)
        self.adapters = AdapterSlots(config.model.vocab_size, NUM_ADAPTERS, seed=3, neutral=neutral)

    def forward(self, inputs) -> torch.Tensor:
        return self.llama(inputs) + self.adapters(inputs)


def buffers():
    return adapter_buffers(MAX_SLOTS, NUM_ADAPTERS)


def lora_step(query_lens: Sequence[int], adapters: Sequence[int], seed: int = 0, *, axes: bool = True) -> StepBatch:
    """A step whose request i uses adapter `adapters[i]` (-1: none): slots in order of first use, `lora` their count."""
    rng = np.random.default_rng(seed)
    q = np.asarray(query_lens, dtype=np.int32)
    used = list(dict.fromkeys(a for a in adapters if a >= 0))
    table = np.full(MAX_SLOTS, -1, dtype=np.int32)
    table[: len(used)] = used
    slots = np.repeat([used.index(a) if a >= 0 else -1 for a in adapters], q)
    seq = q + rng.integers(0, 6, len(q))
    ids = rng.integers(0, 128, int(q.sum()))
    extras = {"lora_slot": slots, "lora_table": table}
    return StepBatch(q, seq, ids, extras=extras, axes={"lora": len(used)} if axes else None)
