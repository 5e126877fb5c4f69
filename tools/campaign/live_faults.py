"""Models whose graphs pass capture-time verification and go wrong later: what `checks.sample_every` catches.

Used by `checks.py` and by `tests/test_sampling.py`.

| model | the fault, switched on after capture | shows in |
|---|---|---|
| `WrongSlice(config, "output")` | row `pad count` of a correct table, not row 0 (`bug`) | a padded replay's output |
| `WrongSlice(config, "kv")` | that row written into a slot-major KV cache (`cache`) | a padded replay's KV slots |
| `StalePlan(config)` | `prepare()`'s host plan from a table the engine updates (`tuning`) | every replay's output |

Both wrap the reference model (`graphcap.models.build_model`), so the rest of the step is the real decoder.
"""

from __future__ import annotations

from typing import Any

import torch

from graphcap.config import PAD_SLOT_ID
from graphcap.models import build_model

__all__ = ["StalePlan", "WrongSlice"]


class WrongSlice(torch.nn.Module):
    """The reference model plus a read of `table[pad count * bug]`: row 0 (all zeros) unless `bug` is set.

    Eager runs unpadded (pad count 0) and reads row 0 whatever `bug` holds; a replay at a padded shape
    reads another row once `bug` is 1: a wrong slice of a correct buffer, at live shapes only. `where`:
    whether the wrong row reaches the output (`"output"`) or only the values the forward writes into
    `cache`, a slot-major KV cache of the built-in group's slots (`"kv"`).
    """

    def __init__(self, config: Any, where: str) -> None:
        super().__init__()
        if where not in ("output", "kv"):
            raise ValueError(f"where must be 'output' or 'kv'; got {where!r}")
        self.llama = build_model(config)
        self.where = where
        rows = config.batching.max_num_tokens + 1
        table = torch.cat([torch.zeros(1, 4), torch.linspace(1, 2, (rows - 1) * 4).view(-1, 4)])
        self.register_buffer("table", table)
        self.register_buffer("bug", torch.zeros((), dtype=torch.long))
        slots = config.kv_cache.num_blocks * config.kv_cache.block_size
        self.register_buffer("cache", torch.zeros(slots + 1, 4))  # the last slot: padded tokens' sink

    def forward(self, inputs: Any) -> torch.Tensor:
        out = self.llama(inputs)
        slots = inputs.slot_mapping.long()
        padding = (slots == PAD_SLOT_ID).sum()  # 0 in an eager run: it is unpadded
        wrong = self.table.index_select(0, (padding * self.bug).view(1))[0]  # [4]: zeros unless padded and bugged
        values = inputs.input_ids.float()[:, None] + wrong
        self.cache.index_copy_(0, torch.where(slots < 0, self.cache.shape[0] - 1, slots), values)
        return out + wrong.sum() if self.where == "output" else out


class StalePlan(torch.nn.Module):
    """The reference model scaled by a host plan `prepare()` computes from a tuning table the engine updates."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.tuning = {"scale": 1.0}  # an autotuner's choice, updated while serving
        self.plan = 1.0

    def prepare(self, inputs: Any, phase: str) -> None:
        self.plan = self.tuning["scale"]  # a Python value: what the graph saw at capture stays in it

    def forward(self, inputs: Any) -> torch.Tensor:
        return self.llama(inputs) * self.plan
