"""mini_engine's model and what graphcap is told about it: the config, the engine buffers, `AdaptedLlama`.

The decoder is graphcap's reference `TinyLlama` plus a sliding-window memory on a second KV-cache
group (`kv_cache.groups`, `graphcap.models.WindowedMemory`), a per-adapter logit bias read through a
per-token engine buffer, a per-request temperature, and with `--lora` LoRA-style adapters in slots
(`graphcap.models.adapters`, the slot count a key axis).
"""

from __future__ import annotations

import torch

from graphcap import BufferSpec
from graphcap.models import TinyLlama, WindowedMemory
from graphcap.models.adapters import AdapterSlots

CONFIG = {
    "device": "cpu",
    "model.hidden_size": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.vocab_size": 256,
    "batching.max_num_seqs": 8,
    "batching.max_num_tokens": 48,
    "kv_cache.block_size": 4,
    "kv_cache.num_blocks": 30,  # few blocks: requests wait, get preempted and reuse stale blocks
    "kv_cache.max_model_len": 48,
    "capture.sizes": [1, 2, 4, 8, 16, 24, 32],
    "checks.invariants": "full",
    # The sliding-window memory's group: 2-token blocks, a 6-token window, enough blocks for every
    # request's window and its largest chunk (its allocator never runs out).
    "kv_cache.groups": [{"name": "window", "block_size": 2, "num_blocks": 96, "sliding_window": 6}],
}
NUM_ADAPTERS = 3
BUFFERS = [
    # A LoRA-style adapter per token (-1: none) and a temperature per request. Capture's own
    # batches sample real values for both, so verification runs the adapted path too.
    BufferSpec("adapter", "tokens", pad=-1, sample=lambda rng, rows: rng.integers(-1, NUM_ADAPTERS, rows)),
    BufferSpec("temperature", "reqs", dtype="float32", pad=1.0, sample=lambda rng, rows: rng.uniform(0.5, 1.5, rows)),
]
LORA_ADAPTERS = 6
"""`--lora`: adapters requests choose from (a step of more than 4 distinct ones runs eagerly)."""
LORA_SLOTS = 8
"""`--lora`: slots of the adapter-id buffer (`lora_table`)."""
LORA = {"capture.axes": {"lora": [0, 1, 2, 4]}}
"""`--lora`: the slot count as a key axis."""


class AdaptedLlama(torch.nn.Module):
    """The engine's model: the reference decoder plus a sliding-window memory on a second KV-cache
    group, a per-adapter logit bias, a per-request temperature.

    `forward` follows graphcap's rules: every per-step value comes from a tensor of `inputs`
    (the adapter and temperature buffers included), padded tokens map to a sink request, and
    nothing is sliced by a Python count.
    """

    def __init__(self, config, *, lora: bool = False) -> None:
        super().__init__()
        self.llama = TinyLlama(config)
        self.memory = WindowedMemory(config, "window")
        vocab = config.model.vocab_size
        self.lora = AdapterSlots(vocab, LORA_ADAPTERS, seed=config.model.seed + 2) if lora else None
        generator = torch.Generator().manual_seed(config.model.seed + 1)
        bias = torch.randn(NUM_ADAPTERS, config.model.vocab_size, generator=generator)
        self.adapter_bias = torch.nn.Parameter(bias, requires_grad=False)  # [A, vocab]

    def adapt(self, logits: torch.Tensor, adapter: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab], adapter [n] (-1: none), temperature [n] -> adapted logits [n, vocab]."""
        adapter = adapter.long()
        bias = self.adapter_bias.index_select(0, adapter.clamp(min=0)) * (adapter >= 0).unsqueeze(1)
        return (logits + bias) / temperature.unsqueeze(1)

    def forward(self, inputs) -> torch.Tensor:
        logits = self.llama(inputs) + self.memory(inputs)  # [T, vocab]
        if self.lora is not None:  # a loop over inputs.axes["lora"] slots: one graph per slot count
            logits = logits + self.lora(inputs)
        qsl, T, R = inputs.query_start_loc, inputs.input_ids.shape[0], inputs.seq_lens.shape[0]
        repeats = torch.cat((qsl.diff(), T - qsl[R:]))  # request R: the sink of padded tokens
        req = torch.repeat_interleave(torch.arange(R + 1, device=qsl.device), repeats, output_size=T)
        temperature = torch.cat((inputs.extras["temperature"], inputs.extras["temperature"].new_ones(1)))
        return self.adapt(logits, inputs.extras["adapter"], temperature.index_select(0, req))
