"""Per-request attention for `TinyLlama`: a Python loop over requests, graph-unsafe on purpose.

With `model.attention: per_request` the reference model attends through `attend_per_request`,
an `eager_op`: a loop over the step's requests that reads their lengths with `.item()`, the way
attention with host-side planning does. No CUDA graph can hold it; in the piecewise modes it
runs eagerly between the graph pieces, and inside full graphs (the uniform keys of
`full_and_piecewise`) its graph-safe stand-in, the model's vectorized paged attention, runs
instead. Both write this step's keys and values into the same paged cache and read the same
keys, so they agree up to float rounding.
"""

from __future__ import annotations

import math

import torch

from graphcap.piecewise import current_inputs, eager_op

__all__ = ["attend_per_request"]


def _vectorized(model, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The graph-safe stand-in: the model's paged attention over the whole padded step."""
    return model._attend(layer, q, k, v, *model._paging(current_inputs()))


@eager_op(capturable=_vectorized)
def attend_per_request(
    model, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q: [T, H, D], k, v: [T, KV, D] -> [T, H*D]; padded tokens (no request) get zeros.

    Writes this step's keys and values at `slot_mapping` (padded tokens into the scratch slot),
    then attends request by request over the keys its block table holds, causally.
    """
    inputs = current_inputs()
    T = q.shape[0]
    KV, D, bs = model.num_kv_heads, model.head_dim, model.block_size
    G = model.num_heads // KV
    slot_mapping = inputs.slot_mapping.long()
    write_slots = torch.where(slot_mapping < 0, model.num_slots, slot_mapping)  # [T]
    model.kv_slots(layer).index_copy_(2, write_slots, torch.stack((k, v)).transpose(1, 2))
    out = q.new_zeros(T, model.num_heads * D) if out is None else out.zero_()
    cache = model.kv_cache[layer]  # [2, KV, num_blocks + 1, bs, D]
    qsl = inputs.query_start_loc
    for i in range(inputs.num_reqs):
        start, end = int(qsl[i].item()), int(qsl[i + 1].item())  # host reads: fine eagerly, fatal in a graph
        seq_len = int(inputs.seq_lens[i].item())
        num_blocks = -(-seq_len // bs)
        blocks = inputs.block_table[i, :num_blocks].long()
        kv = cache[:, :, blocks].reshape(2, KV, num_blocks * bs, D)[:, :, :seq_len]  # [2, KV, L, D]
        keys, values = kv.unbind(0)
        n = end - start
        queries = (q[start:end] * (1.0 / math.sqrt(D))).view(n, KV, G, D).transpose(0, 1)  # [KV, n, G, D]
        scores = torch.einsum("kngd,kld->kngl", queries, keys)  # [KV, n, G, L]
        position = seq_len - n + torch.arange(n, device=q.device)  # [n]
        future = torch.arange(seq_len, device=q.device)[None, :] > position[:, None]  # [n, L]
        scores = scores.masked_fill(future[None, :, None, :], torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
        out[start:end] = torch.einsum("kngl,kld->nkgd", probs, values).reshape(n, model.num_heads * D)
    return out
