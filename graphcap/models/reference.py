"""Dense, unpaged reference forward of `TinyLlama`, the oracle for the paged path.

`dense_reference` runs each request on its own with plain causal attention over all its
tokens: no KV cache, no block table, no padding, no shared batch. It shares every weight
with the model (through `DecoderLayer.project_qkv` / `finish`) and nothing of the paged
attention, so a paging, masking or padding bug shows up as a difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from graphcap.models.llama import TinyLlama

__all__ = ["dense_reference"]


@torch.no_grad()
def dense_reference(model: TinyLlama, token_ids_per_request: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Logits of every position of every request, computed densely: `[n_i, vocab]` float32 each.

    Request i's tokens sit at positions `0 .. n_i - 1`. Row p of the result equals what the
    paged forward returns for the token at position p, however the request was split into
    steps. Does not read or write `model.kv_cache`.
    """
    device = model.embed.device
    out = []
    for tokens in token_ids_per_request:
        ids = torch.as_tensor(list(tokens), dtype=torch.int64, device=device)  # ids: [n]
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"each request needs at least one token id; got {list(tokens)!r}")
        n = ids.numel()
        cos, sin = model.rope(torch.arange(n, device=device))
        h = model.embed.index_select(0, ids)  # h: [n, E]
        for layer in model.decoder_layers:
            q, k, v = layer.project_qkv(h, cos, sin)
            h = layer.finish(h, _causal_attention(q, k, v))
        out.append(model.logits(h))
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [n, H, D], k, v: [n, KV, D] -> [n, H*D]; query head h reads KV head h // (H/KV)."""
    n, H, D = q.shape
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # k: [n, H, D]
    v = v.repeat_interleave(group, dim=1)  # v: [n, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # scores: [H, n, n]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, H * D)
