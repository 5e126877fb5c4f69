"""Scratch blocks must be free: a block a live row of a persistent block table holds is refused before capture.

`capture(scratch_blocks=...)`, `capture_pending(scratch_blocks=...)` and `group_scratch_blocks` name blocks
verification may overwrite. A block that a row of `manager.block_table` (or of a KV-cache group's table)
holds belongs to a live request: the refusal names the row (and group), and the KV cache is left bit-identical.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from graphcap import CaptureManager
from graphcap.models import WindowedMemory, build_model
from graphcap.probe import check_scratch_free
from graphcap.testing import make_config, make_manager

SCRATCH = list(range(40, 72))


def _random_cache(cache: torch.Tensor, seed: int) -> torch.Tensor:
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
    return cache.clone()


@pytest.mark.parametrize("call", ["capture", "capture_pending"])
def test_scratch_blocks_a_live_row_holds_are_refused_naming_the_row_and_the_cache_is_untouched(call):
    manager = make_manager(make_config({"capture.strategy": "lazy"} if call == "capture_pending" else {}))
    manager.block_table.set_row(0, [3, 4])
    manager.block_table.set_row(2, [45, 46])  # a live request holds two of the scratch blocks
    before = _random_cache(manager.model.kv_cache, 1)
    with pytest.raises(ValueError, match=r"scratch_blocks holds block 45, which row 2 of the persistent block table"):
        getattr(manager, call)(scratch_blocks=SCRATCH)
    assert torch.equal(manager.model.kv_cache, before)
    assert not manager.graphs
    manager.block_table.clear(2)  # the request finished: its blocks are free now
    getattr(manager, call)(scratch_blocks=SCRATCH)
    assert manager.graphs


def test_canary_without_the_check_verification_overwrites_the_live_rows_blocks(monkeypatch):
    manager = make_manager(make_config())
    for row in range(4):  # every scratch block is live
        manager.block_table.set_row(row, SCRATCH[8 * row : 8 * row + 8])
    cache = manager.model.kv_cache
    before = _random_cache(cache, 2)
    monkeypatch.setattr("graphcap.capture.capturer.check_scratch_free", lambda *args: None)
    # and without putting back what the probes wrote (graphcap.capture.restore)
    monkeypatch.setattr(
        "graphcap.capture.capturer.kept_blocks", lambda parts, scratch, keys, caches: contextlib.nullcontext(scratch)
    )
    manager.capture(scratch_blocks=SCRATCH)
    live = torch.tensor(SCRATCH)
    assert not torch.equal(cache[:, :, :, live], before[:, :, :, live]), "the hazard: a live request's KV written"


class Hybrid(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.memory = WindowedMemory(config, "window")

    def forward(self, inputs):
        return self.llama(inputs) + self.memory(inputs)


def test_group_scratch_blocks_a_live_group_row_holds_are_refused_naming_the_group_and_row():
    config = make_config(
        {"kv_cache.groups": [{"name": "window", "block_size": 2, "num_blocks": 90, "sliding_window": 5}]}
    )
    manager = CaptureManager(Hybrid(config), config, progress=False)
    manager.kv_group_tables["window"].set_row(1, [70, 71])
    before = _random_cache(manager.model.memory.cache, 3)
    kv_before = _random_cache(manager.model.llama.kv_cache, 4)
    with pytest.raises(
        ValueError, match=r"group_scratch_blocks\['window'\] holds block 70, which row 1 of KV-cache group 'window'"
    ):
        manager.capture(scratch_blocks=SCRATCH, group_scratch_blocks={"window": range(60, 90)})
    assert torch.equal(manager.model.memory.cache, before)
    assert torch.equal(manager.model.llama.kv_cache, kv_before)
    manager.capture(scratch_blocks=SCRATCH, group_scratch_blocks={"window": range(72, 90)})  # free ones: accepted
    assert manager.graphs


def test_an_empty_table_or_no_scratch_holds_nothing():
    manager = make_manager(make_config())
    check_scratch_free((), {}, manager.block_table, {})
    check_scratch_free(tuple(SCRATCH), {}, manager.block_table, {})
    manager.block_table.set_row(0, [5])
    assert manager.block_table.holding([5, 6]) == (0, 5)
    assert manager.block_table.holding([6]) is None
