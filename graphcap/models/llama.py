"""`TinyLlama`: the reference model, a Llama-style decoder over a paged KV cache.

It is written the way a CUDA graph needs a model to be: every shape comes from the padded
key (`T` tokens, `R` requests) and the cache geometry, never from tensor values; nothing
reads a device value on the host; the padded tail is handled by arithmetic, not by
slicing off the real rows. So the same forward runs eagerly, under capture, and on replay.

The token -> request map deliberately uses `repeat_interleave` over the query lengths, as
real attention backends do, so a broken `query_start_loc` tail fails here exactly as it
failed in production (`repeats can not be negative` on CPU, a device assert on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from graphcap.config import CaptureConfig, ModelConfig
from graphcap.models.per_request import attend_per_request

__all__ = ["DecoderLayer", "TinyLlama"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DRAW_ON_DEVICE = 200_000_000  # parameters


class _WeightInit:
    """Deterministic weights from one generator, drawn in construction order.

    Small models draw on the CPU in float32 and move, so CPU and GPU builds of one seed hold
    the same weights. Models above `_DRAW_ON_DEVICE` parameters draw on a CUDA device with
    its own generator: the CPU generator would take minutes for an 8B-shaped model. Same
    seed, same weights on the same kind of device either way.
    """

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype, num_params: int) -> None:
        on_device = device.type == "cuda" and num_params > _DRAW_ON_DEVICE
        self.draw_device = device if on_device else torch.device("cpu")
        self.generator = torch.Generator(device=self.draw_device).manual_seed(seed)
        self.device, self.dtype = device, dtype

    def normal(self, *shape: int, std: float, mean: float = 0.0) -> nn.Parameter:
        w = torch.randn(shape, generator=self.generator, device=self.draw_device) * std + mean
        return nn.Parameter(w.to(self.device, self.dtype), requires_grad=False)

    def linear(self, out_features: int, in_features: int) -> nn.Parameter:
        # std 1/sqrt(fan_in) keeps activations near unit scale, so attention scores are
        # far from uniform and a wrong key or mask changes the output visibly.
        return self.normal(out_features, in_features, std=in_features**-0.5)

    def norm(self, size: int) -> nn.Parameter:
        return self.normal(size, std=0.1, mean=1.0)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Float32 statistics, so bfloat16/float16 builds stay close to the float32 one.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves of each head (GPT-NeoX layout). x: [T, heads, D]; cos, sin: [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    """One pre-norm block: attention (GQA, rotary) then a SwiGLU MLP, both residual.

    Attention itself is not here: `project_qkv` gives the rotated q, k, v and `finish`
    takes the attention output, so the paged model and the dense reference share every
    weight and differ only in how they attend.
    """

    def __init__(self, cfg: ModelConfig, init: _WeightInit) -> None:
        super().__init__()
        E, H, KV, D, Fs = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = H, KV, D, cfg.rms_norm_eps
        self.attn_norm = init.norm(E)
        self.qkv_proj = init.linear((H + 2 * KV) * D, E)  # fused [q; k; v] rows
        self.o_proj = init.linear(E, H * D)
        self.mlp_norm = init.norm(E)
        self.gate_up_proj = init.linear(2 * Fs, E)  # fused [gate; up] rows
        self.down_proj = init.linear(E, Fs)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, E] -> q: [T, H, D], k: [T, KV, D] (both rotated), v: [T, KV, D]."""
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(_rms_norm(x, self.attn_norm, self.eps), self.qkv_proj)  # qkv: [T, (H+2KV)*D]
        q, k, v = qkv.split((H * D, KV * D, KV * D), dim=-1)
        q = _apply_rope(q.view(T, H, D), cos, sin)
        k = _apply_rope(k.view(T, KV, D), cos, sin)
        return q, k, v.reshape(T, KV, D)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: [T, E], attn: [T, H*D] -> the block's output [T, E]."""
        x = x + F.linear(attn, self.o_proj)
        gate, up = F.linear(_rms_norm(x, self.mlp_norm, self.eps), self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


class TinyLlama(nn.Module):
    """Llama-style decoder with a paged KV cache; `forward(inputs) -> logits [T, vocab]` float32.

    Contract of `forward(inputs: ForwardInputs)`: `inputs` follows the pad rules (see
    DESIGN.md); the KV cache is written at `slot_mapping` (negative slots land in a scratch
    block, never in a live slot) and read through `block_table`. Every row of the output is
    finite, padded rows included; only the first `inputs.num_tokens` rows mean anything.
    The cache tensor is allocated once and only ever written in place, so a captured graph
    keeps pointing at it.

    Not here: scheduling, block allocation, sampling, or any host-side planning (no
    `prepare`); the forward reads nothing on the host and is capturable as is.
    """

    output_rows = "tokens"
    """Every row of the logits is a token's (`graphcap.outputs`): steps cut them to the real tokens."""

    rope_cos: torch.Tensor  # buffers (register_buffer), declared for the type checker
    rope_sin: torch.Tensor
    kv_cache: torch.Tensor
    _plane_offsets: torch.Tensor

    def __init__(self, config: CaptureConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        cfg, kv = config.model, config.kv_cache
        device, dtype = torch.device(device), _DTYPES[cfg.dtype]
        init = _WeightInit(cfg.seed, device, dtype, _num_params(cfg))
        self.config = config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.block_size, self.num_slots = kv.block_size, kv.num_slots
        self.eps = cfg.rms_norm_eps
        self.attention = cfg.attention
        self.embed = init.normal(cfg.vocab_size, cfg.hidden_size, std=1.0)
        self.layers = nn.ModuleList(DecoderLayer(cfg, init) for _ in range(cfg.num_layers))
        self.norm = init.norm(cfg.hidden_size)
        self.lm_head = init.linear(cfg.vocab_size, cfg.hidden_size)

        # Rotary tables, computed in float64 then cast to the model dtype; rows are positions.
        inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        angles = torch.outer(torch.arange(kv.max_model_len, dtype=torch.float64), inv_freq)
        # rope_cos, rope_sin: [max_model_len, D/2]
        self.register_buffer("rope_cos", angles.cos().to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(device, dtype), persistent=False)

        # Block-granular and head-major: a token's keys for one head are its request's
        # blocks, each one contiguous [block_size, D] run, so the per-layer gather is one
        # index_select of whole blocks and lands in the [KV, T, L, D] layout the attention
        # matmuls read without a copy. Block `num_blocks` is scratch: PAD tokens write its
        # first row (slot `num_slots`), so they can never hit a live slot; nothing reads it.
        # kv_cache: [num_layers, 2 (k, v), num_kv_heads, num_blocks + 1, block_size, head_dim]
        cache = torch.zeros(
            cfg.num_layers,
            2,
            cfg.num_kv_heads,
            kv.num_blocks + 1,
            kv.block_size,
            cfg.head_dim,
            device=device,
            dtype=dtype,
        )
        self.register_buffer("kv_cache", cache, persistent=False)
        # Row of each (k/v, kv head) plane in the cache viewed as [2*KV*(num_blocks+1), bs*D].
        planes = torch.arange(2 * cfg.num_kv_heads, device=device) * (kv.num_blocks + 1)
        self.register_buffer("_plane_offsets", planes.view(-1, 1, 1), persistent=False)  # [2*KV, 1, 1]

    @property
    def kv_cache_num_blocks(self) -> int:
        """Blocks the cache holds, the null block included (what `CaptureManager` checks the config against)."""
        return self.kv_cache.shape[3] - 1

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Re-allocate the cache with `num_blocks` blocks, keeping the blocks both sizes hold.

        A new tensor, as an engine re-allocates after a memory profile: graphs captured before read
        the old one (the manager's guard refuses their replays); call `manager.resize_kv(num_blocks)`.
        """
        old = self.kv_cache
        shape = list(old.shape)
        shape[3] = num_blocks + 1  # + the scratch block PAD tokens write
        cache = old.new_zeros(shape)
        kept = min(num_blocks, old.shape[3] - 1)
        cache[:, :, :, :kept] = old[:, :, :, :kept]
        self.num_slots = num_blocks * self.block_size
        self.kv_cache = cache
        planes = torch.arange(2 * self.num_kv_heads, device=cache.device) * (num_blocks + 1)
        self._plane_offsets = planes.view(-1, 1, 1)

    @property
    def scratch_slot(self) -> int:
        """The slot PAD tokens write: row 0 of the scratch block `num_blocks`."""
        return self.num_slots

    def kv_slots(self, layer: int) -> torch.Tensor:
        """`kv_cache[layer]` as slots, a view: [2, KV, num_slots + block_size, D] (slot = block * bs + offset)."""
        c = self.kv_cache[layer]
        return c.view(2, self.num_kv_heads, -1, self.head_dim)

    def reset_kv_cache(self) -> None:
        """Zero the cache in place; its address never changes (captured graphs read it)."""
        self.kv_cache.zero_()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, D/2] (rows of the precomputed tables)."""
        return self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and lm head: h [T, E] -> logits [T, vocab] float32."""
        return F.linear(_rms_norm(h, self.norm, self.eps), self.lm_head).float()

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers`, typed: the `DecoderLayer`s in order."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def forward(self, inputs) -> torch.Tensor:
        """Run one padded step; returns logits [T, vocab_size] float32 (see the class doc)."""
        cos, sin = self.rope(inputs.positions)
        h = self.embed.index_select(0, inputs.input_ids)  # h: [T, E]
        if self.attention == "per_request":  # an eager_op between graph pieces (see per_request.py)
            for i, layer in enumerate(self.decoder_layers):
                q, k, v = layer.project_qkv(h, cos, sin)
                h = layer.finish(h, attend_per_request(self, i, q, k, v))
            return self.logits(h)
        write_slots, read_rows, visible = self._paging(inputs)
        for i, layer in enumerate(self.decoder_layers):
            q, k, v = layer.project_qkv(h, cos, sin)
            h = layer.finish(h, self._attend(i, q, k, v, write_slots, read_rows, visible))
        return self.logits(h)

    def _paging(self, inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-step index tensors shared by every layer.

        Returns write_slots [T] (int64; PAD -> the scratch slot), read_rows [2*KV*T*B]
        (int64; for each k/v plane, kv head, token and block-table column, the cache block
        the token reads, i.e. slots `block * bs + arange(bs)`) and visible [T, L] (bool;
        which of those L = B * bs keys the token sees).
        """
        qsl, seq_lens, block_table = inputs.query_start_loc, inputs.seq_lens, inputs.block_table
        T, (R, B), bs = inputs.input_ids.shape[0], block_table.shape, self.block_size
        device = qsl.device
        # Request R is a sink: it owns the padded tokens after query_start_loc[R] and has
        # seq_len 0 and the null block, so those tokens attend to nothing.
        repeats = torch.cat((qsl.diff(), T - qsl[R:]))  # repeats: [R+1]
        req = torch.repeat_interleave(torch.arange(R + 1, device=device), repeats, output_size=T)  # req: [T]
        seq_lens = torch.cat((seq_lens, seq_lens.new_zeros(1)))  # seq_lens: [R+1]
        block_table = torch.cat((block_table, block_table.new_zeros(1, B)))  # block_table: [R+1, B]

        blocks = block_table.index_select(0, req)  # blocks: [T, B]
        read_rows = (self._plane_offsets + blocks).view(-1)  # read_rows: [2*KV*T*B]
        j = torch.arange(B * bs, device=device)  # j: [L], key index within the request
        token_seq_len = seq_lens.index_select(0, req)  # token_seq_len: [T]
        # Keys past the request's length are stale slots; keys after the token's own
        # position are its future (causal within a chunked prefill).
        visible = (j < token_seq_len[:, None]) & (j <= inputs.positions[:, None])  # visible: [T, L]
        slot_mapping = inputs.slot_mapping.long()
        write_slots = torch.where(slot_mapping < 0, self.num_slots, slot_mapping)  # write_slots: [T]
        return write_slots, read_rows, visible

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        write_slots: torch.Tensor,
        read_rows: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's k, v into the cache, then attend through it. Returns [T, H*D]."""
        T, L = visible.shape
        KV, D = self.num_kv_heads, self.head_dim
        G = self.num_heads // KV
        # Scattered writes of T rows, then one gather of whole blocks for keys and values.
        self.kv_slots(layer).index_copy_(2, write_slots, torch.stack((k, v)).transpose(1, 2))  # src: [2, KV, T, D]
        blocks = self.kv_cache[layer].view(-1, self.block_size * D)  # blocks: [2*KV*(NB+1), bs*D]
        kv = blocks.index_select(0, read_rows).view(2, KV, T, L, D)  # kv: [2, KV, T, L, D]
        keys, values = kv.unbind(0)  # keys, values: [KV, T, L, D]
        q = (q * (1.0 / math.sqrt(D))).view(T, KV, G, D).transpose(0, 1)  # q: [KV, T, G, D]
        scores = q @ keys.transpose(-1, -2)  # scores: [KV, T, G, L]
        # A finite fill (not -inf) keeps fully masked rows (padded tokens) free of NaN.
        scores.masked_fill_(~visible[None, :, None, :], torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
        out = probs @ values  # out: [KV, T, G, D]
        return out.transpose(0, 1).reshape(T, self.num_heads * D)


def _num_params(cfg) -> int:
    """Parameters of the model `cfg` describes (embedding, layers, final norm, lm head)."""
    kv_width = cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (cfg.hidden_size * 2 + kv_width * 2)
    mlp = 3 * cfg.hidden_size * cfg.ffn_size
    per_layer = attention + mlp + 2 * cfg.hidden_size
    return 2 * cfg.vocab_size * cfg.hidden_size + cfg.num_layers * per_layer + cfg.hidden_size
