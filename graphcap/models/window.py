"""`WindowedMemory`: a sliding-window layer over a second KV-cache group, the hybrid part of a reference model.

Hybrid models (Gemma's sliding-window layers beside full attention, attention beside state-space
layers) keep more than one paged cache, each with its own block size and block table. This
layer is such a cache in small, on a group of `kv_cache.groups` with a `sliding_window`: each
token writes one value vector (its row of a value table) at its slot of the group, then reads,
through the group's block table, the values of its request's last `sliding_window` tokens (its
own included); their mean, projected to the vocabulary, is a logit bias. Like `TinyLlama` it is
written for graphs: shapes come from the padded key, padded tokens write the scratch row and
read nothing, and the engine may point columns that left the window at the null block.

`window_reference` computes the same bias densely per request (no cache, paging or padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from graphcap.config import CaptureConfig

__all__ = ["WindowedMemory", "window_reference"]


class WindowedMemory(nn.Module):
    """`forward(inputs) -> logit bias [T, vocab]` from the window of group `group` (see the module doc).

    The cache is `[num_blocks * block_size + 1, dim]`: slot `block * block_size + offset`, the last
    row the scratch that PAD tokens write. Allocated once and written in place.
    """

    cache: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, config: CaptureConfig, group: str, *, dim: int = 8, seed: int = 1) -> None:
        super().__init__()
        spec = next((g for g in config.kv_cache.groups if g.name == group), None)
        if spec is None or spec.sliding_window is None or spec.num_blocks is None:
            raise ValueError(f"WindowedMemory needs a kv_cache.groups entry {group!r} with a sliding_window")
        self.group, self.window, self.block_size = group, spec.sliding_window, spec.block_size
        generator = torch.Generator().manual_seed(seed)
        vocab = config.model.vocab_size
        self.values = nn.Parameter(torch.randn(vocab, dim, generator=generator), requires_grad=False)  # [V, dim]
        self.out = nn.Parameter(torch.randn(dim, vocab, generator=generator), requires_grad=False)  # [dim, V]
        self.register_buffer("cache", torch.zeros(spec.num_blocks * spec.block_size + 1, dim), persistent=False)

    @property
    def scratch_slot(self) -> int:
        return self.cache.shape[0] - 1

    def resize_cache(self, num_blocks: int) -> None:
        """Re-allocate the cache for `num_blocks` blocks, keeping the slots both sizes hold."""
        old, slots = self.cache, num_blocks * self.block_size
        cache = old.new_zeros(slots + 1, old.shape[1])
        kept = min(slots, old.shape[0] - 1)
        cache[:kept] = old[:kept]
        self.cache = cache

    def forward(self, inputs) -> torch.Tensor:
        rows = inputs.kv_groups[self.group]
        qsl, ids = inputs.query_start_loc, inputs.input_ids
        T, R = ids.shape[0], inputs.seq_lens.shape[0]
        B, bs = rows.block_table.shape[1], self.block_size
        device = ids.device
        repeats = torch.cat((qsl.diff(), T - qsl[R:]))  # request R: the sink of padded tokens
        req = torch.repeat_interleave(torch.arange(R + 1, device=device), repeats, output_size=T)  # [T]
        table = torch.cat((rows.block_table, rows.block_table.new_zeros(1, B))).long()  # [R+1, B]
        seq_lens = torch.cat((inputs.seq_lens, inputs.seq_lens.new_zeros(1)))  # [R+1]
        slots = rows.slot_mapping.long()
        self.cache.index_copy_(0, torch.where(slots < 0, self.scratch_slot, slots), self.values.index_select(0, ids))
        offsets = torch.arange(bs, device=device)
        read = (table.index_select(0, req)[:, :, None] * bs + offsets).view(T, B * bs)  # [T, L], L = B * bs
        j = torch.arange(B * bs, device=device)
        pos = inputs.positions.long()[:, None]
        visible = (j <= pos) & (j > pos - self.window) & (j < seq_lens.index_select(0, req)[:, None])  # [T, L]
        values = self.cache.index_select(0, read.view(-1)).view(T, B * bs, -1)  # [T, L, dim]
        values = torch.where(visible[..., None], values, values.new_zeros(()))  # masked keys may be stale
        mean = values.sum(1) / visible.sum(1, keepdim=True).clamp(min=1)  # [T, dim]
        return mean @ self.out


@torch.no_grad()
def window_reference(memory: WindowedMemory, token_ids_per_request: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The bias of every position of every request, densely: `[n_i, vocab]` each (no cache, no paging)."""
    out = []
    for tokens in token_ids_per_request:
        values = memory.values.index_select(0, torch.as_tensor(list(tokens), dtype=torch.long))  # [n, dim]
        sums = values.cumsum(0)
        shifted = torch.cat((values.new_zeros(memory.window, values.shape[1]), sums))[: len(tokens)]
        count = torch.clamp(torch.arange(1, len(tokens) + 1), max=memory.window)[:, None]
        out.append(((sums - shifted) / count) @ memory.out)
    return out
