"""Sampled live steps (`checks.sample_every`) with key axes and with KV-cache groups: the eager run of a sampled
step states the step's own axis values, and each group's cache is compared at that group's slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcap import PAD_SLOT_ID, CaptureManager, ReplayMismatchError, StepBatch
from graphcap.checks.sampling import locate
from graphcap.models import build_model
from graphcap.testing import make_config
from tests.axes_models import AXES, SlotLlama, buffers, lora_step

AXIS_STEPS = [([1, 1, 1], [0, 1, 2]), ([2, 1], [5, -1]), ([1, 1], [-1, -1]), ([3, 2, 1], [4, 4, 3])]


class AxisReader(torch.nn.Module):
    """The reference model plus a bias per adapter slot, looping over `inputs.axes.get("lora", 0)` slots as an
    engine's own LoRA layer does; a token gets its slot's bias (a padded slot: no token, nothing)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.bias = torch.nn.Parameter(torch.randn(8, config.model.vocab_size), requires_grad=False)

    def forward(self, inputs) -> torch.Tensor:
        out = self.llama(inputs)
        slot = inputs.extras["lora_slot"]  # [T]: -1 for none
        for s in range(inputs.axes.get("lora", 0)):
            out = out + (slot == s).unsqueeze(1) * self.bias[s]
        return out


@pytest.mark.parametrize("model", [SlotLlama, AxisReader])
def test_a_sampled_step_of_an_axis_key_runs_eagerly_at_the_steps_axis_values(model):
    torch.set_num_threads(1)
    config = make_config({"capture.axes": AXES, "capture.sizes": [4, 8], "checks.sample_every": 1})
    manager = CaptureManager(model(config), config, progress=False, buffers=buffers())
    report = manager.capture()
    assert report.records and all(record.verified for record in report.captured)
    for query_lens, adapters in AXIS_STEPS:  # before the fix: KeyError 'lora', or a false ReplayMismatchError
        batch = lora_step(query_lens, adapters, seed=len(query_lens))
        output = manager.execute(batch).clone()
        torch.testing.assert_close(output, manager.eager(batch))
    assert manager._sampler.checked == len(AXIS_STEPS) and sum(manager.stats.graph_hits.values()) == len(AXIS_STEPS)


GROUP = {"name": "g2", "block_size": 4, "num_blocks": 72}  # the built-in cache's geometry (TINY)


class GroupWriter(torch.nn.Module):
    """The reference model plus a slot-major cache of the group `g2`, written at the group's slots.

    `drop` set (after capture): a padded replay sends every write to the sink, an eager run (unpadded)
    still writes the group's slots. The output never reads the cache: only the KV comparison can see it.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.register_buffer("g2_cache", torch.zeros(GROUP["num_blocks"] * GROUP["block_size"] + 1, 4))
        self.register_buffer("drop", torch.zeros((), dtype=torch.long))

    def forward(self, inputs) -> torch.Tensor:
        slots = inputs.kv_groups["g2"].slot_mapping.long()
        padding = (inputs.slot_mapping == PAD_SLOT_ID).sum()  # 0 in an eager run
        sink = self.g2_cache.shape[0] - 1
        where = torch.where((slots < 0) | (padding * self.drop > 0), sink, slots)
        self.g2_cache.index_copy_(0, where, inputs.input_ids.float()[:, None].expand(-1, 4) + 1)
        return self.llama(inputs)


def _group_step(num_reqs: int, seed: int) -> StepBatch:
    rng = np.random.default_rng(seed)
    q = np.ones(num_reqs, dtype=np.int32)
    seq = q + rng.integers(0, 12, num_reqs)
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    group_table = table + 30  # other blocks than the built-in cache's: other slots
    return StepBatch(q, seq, rng.integers(0, 128, num_reqs), table, kv_groups={"g2": group_table})


def test_locate_finds_a_tensor_of_the_shared_geometry_for_the_built_in_cache_and_the_group():
    cache = torch.zeros(72 * 4 + 1, 4)
    found = locate({"g2_cache": cache}, [(None, 4, 72), ("g2", 4, 72)])
    assert [(c.name, c.group) for c in found] == [("g2_cache", None), ("g2_cache", "g2")]


def test_a_replay_that_drops_a_groups_writes_is_named_with_the_group():
    config = make_config({"kv_cache.groups": [GROUP], "checks.sample_every": 1})
    manager = CaptureManager(GroupWriter(config), config, progress=False)
    assert all(record.verified for record in manager.capture().captured)
    batch = _group_step(3, 0)  # 3 decode tokens: replayed padded to 4
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    manager.model.drop.fill_(1)  # the fault, after capture: an in-place write the guard accepts
    with pytest.raises(
        ReplayMismatchError, match=r"the KV slots its tokens write in 'model\.g2_cache' \(kv_cache\.groups 'g2'\)"
    ):
        manager.execute(_group_step(3, 1))  # other tokens: the slots the replay drops hold other values
