"""`AdapterSlots`: LoRA-style adapters served from slots, the slot count a key axis (`capture.axes`).

An engine loads the adapters a step uses into slots (vLLM's and SGLang's LoRA managers do), and the
forward loops over the slots: the loop's length is Python-level structure, so it is a key axis, padded
like token counts (`capture.axes: {lora: [0, 1, 2, 4]}`). The real values reach the model as two
engine buffers (`BufferSpec`s the engine stages every step): which adapter each slot holds (`-1`: an
empty slot) and which slot each token uses (`-1`: none). A padded slot is empty and no token names it,
so it must add nothing: `neutral=False` builds the classic bug, an empty slot whose (clamped) adapter is
applied to every token, which capture verification refuses, naming the axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from graphcap.inputs import BufferSpec

__all__ = ["AdapterSlots", "adapter_buffers"]

SLOT_BUFFER = "lora_slot"
"""Per token: the slot of the adapter the token uses, -1 for none (pad -1)."""
TABLE_BUFFER = "lora_table"
"""Whole: the adapter id each slot holds, -1 for an empty slot (pad -1: every slot empty)."""


def adapter_buffers(max_slots: int, num_adapters: int, axis: str = "lora") -> tuple[BufferSpec, BufferSpec]:
    """The two engine buffers `AdapterSlots` reads, with samples that fill `axes[axis]` slots (capture's batches)."""

    def slot_sample(rng: np.random.Generator, rows: int, axes: dict) -> np.ndarray:
        return rng.integers(-1, axes.get(axis, 0), rows)  # -1: a token with no adapter

    def table_sample(rng: np.random.Generator, rows: int, axes: dict) -> np.ndarray:
        table = np.full(max_slots, -1, dtype=np.int32)
        used = min(axes.get(axis, 0), max_slots)
        table[:used] = rng.choice(num_adapters, used, replace=used > num_adapters)
        return table

    return (
        BufferSpec(SLOT_BUFFER, "tokens", pad=-1, sample=slot_sample),
        BufferSpec(TABLE_BUFFER, "none", shape=(max_slots,), pad=-1, sample=table_sample),
    )


class AdapterSlots(nn.Module):
    """Per-token low-rank logit deltas: token t with slot s gains `emb[t] @ A[a] @ B[a]`, `a` the adapter in slot s.

    `forward(inputs) -> [T, vocab]` loops over `inputs.axes[axis]` slots (the key's value), reading the slot
    table and each token's slot from the engine buffers (`adapter_buffers`); `reference(token_ids, adapter)`
    is the same delta for one request's tokens with its adapter id (-1: none), without slots.
    """

    def __init__(
        self,
        vocab_size: int,
        num_adapters: int,
        *,
        rank: int = 4,
        dim: int = 16,
        axis: str = "lora",
        seed: int = 0,
        neutral: bool = True,
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.axis, self.neutral = axis, neutral

        def weight(*shape: int, scale: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * scale, requires_grad=False)

        self.embed = weight(vocab_size, dim, scale=dim**-0.5)
        self.lora_a = weight(num_adapters, dim, rank, scale=1.0)
        self.lora_b = weight(num_adapters, rank, vocab_size, scale=1 / rank)

    def forward(self, inputs) -> torch.Tensor:
        slots, table = inputs.extras[SLOT_BUFFER], inputs.extras[TABLE_BUFFER]
        x = self.embed.index_select(0, inputs.input_ids.long())  # [T, dim]
        out = x.new_zeros(x.shape[0], self.lora_b.shape[2])
        for s in range(inputs.axes[self.axis]):  # Python structure: one graph per slot count
            adapter = table[s : s + 1].long()  # [1]: which adapter slot s holds (-1: empty)
            a = self.lora_a.index_select(0, adapter.clamp(min=0))[0]
            b = self.lora_b.index_select(0, adapter.clamp(min=0))[0]
            mask = (slots == s) & (adapter >= 0) if self.neutral else (slots == s) | (adapter < 0)
            out = out + mask.unsqueeze(1).to(x.dtype) * (x @ a @ b)
        return out

    def reference(self, token_ids: Sequence[int], adapter: int) -> torch.Tensor:
        """The delta of one request's tokens under adapter `adapter` (-1: none): `[len(token_ids), vocab]`."""
        x = self.embed.index_select(0, torch.as_tensor(list(token_ids), dtype=torch.long))
        if adapter < 0:
            return x.new_zeros(x.shape[0], self.lora_b.shape[2])
        return x @ self.lora_a[adapter] @ self.lora_b[adapter]
