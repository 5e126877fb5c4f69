"""Capture puts back what it wrote: every block a pass's probes may write is saved and restored byte for byte.

The docs advise `capture(scratch_blocks=free_blocks)`; in a prefix-caching engine a free block still holds a
cached prefix that later requests hit. A mid-run re-capture must leave it as it was, on success, on a failure
and on an interrupt (`graphcap.capture.restore`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from graphcap import CaptureError, CaptureManager, StepBatch
from graphcap.capture.restore import probe_block_bound
from graphcap.keys import GraphKey
from graphcap.models import WindowedMemory, build_model
from graphcap.phases import phase
from graphcap.testing import make_config, make_manager

SCRATCH = list(range(40, 72))  # free blocks of TINY's 72: in a prefix-caching engine, cached prefixes
PREFIX = StepBatch([1], [9], [7], [[40, 41, 42]])  # a request whose first 8 keys are the cached prefix in 40, 41


def _cached(cache: torch.Tensor, seed: int) -> torch.Tensor:
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
    return cache.clone()


def _all_but_null(cache: torch.Tensor) -> torch.Tensor:
    return cache[:, :, :, 1:]  # [layers, 2, heads, blocks, block_size, dim]: block 0 is graphcap's


def _unguarded(monkeypatch) -> None:
    monkeypatch.setattr(
        "graphcap.capture.capturer.kept_blocks", lambda parts, scratch, keys, caches: contextlib.nullcontext(scratch)
    )


def test_canary_without_the_restore_a_recapture_overwrites_a_cached_prefix_in_a_free_block(monkeypatch):
    _unguarded(monkeypatch)
    manager = make_manager(make_config())
    before = _cached(manager.model.kv_cache, 1)
    manager.capture(scratch_blocks=SCRATCH)
    assert not torch.equal(_all_but_null(manager.model.kv_cache), _all_but_null(before)), "the hazard"


def test_a_recapture_into_free_blocks_leaves_every_cached_prefix_byte_identical_and_prefix_hits_read_it():
    manager = make_manager(make_config())
    manager.capture(scratch_blocks=SCRATCH)
    cache = manager.model.kv_cache
    before = _cached(cache, 2)
    hit = manager.eager(PREFIX).clone()  # a prefix hit reads blocks 40 and 41
    cache.copy_(before)
    report = manager.capture(scratch_blocks=SCRATCH)  # mid-run re-capture
    assert all(record.verified for record in report.captured)
    assert torch.equal(_all_but_null(cache), _all_but_null(before))
    torch.testing.assert_close(manager.execute(PREFIX).clone(), hit)


class Failing(torch.nn.Module):
    """The reference model, raising `error` at its `at`-th verification run (after probes wrote scratch blocks)."""

    def __init__(self, config, error: BaseException, at: int) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.error, self.at, self.calls = error, at, 0

    def forward(self, inputs):
        if phase() == "verify":
            self.calls += 1
            if self.calls == self.at:
                raise self.error
        return self.llama(inputs)


@pytest.mark.parametrize(
    "error, raised, match",
    [
        (RuntimeError("a verification run failed"), CaptureError, "a verification run failed"),
        (KeyboardInterrupt(), KeyboardInterrupt, None),
    ],
)
def test_the_blocks_are_put_back_when_the_pass_fails_or_is_interrupted(error, raised, match):
    config = make_config({"capture.on_error": "raise"})
    model = Failing(config, error, at=5)
    manager = CaptureManager(model, config, progress=False)
    before = _cached(model.llama.kv_cache, 3)
    with pytest.raises(raised, match=match):
        manager.capture(scratch_blocks=SCRATCH)
    assert model.calls == 5
    assert torch.equal(_all_but_null(model.llama.kv_cache), _all_but_null(before))
    assert not manager.graphs


class Hybrid(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.memory = WindowedMemory(config, "window")

    def forward(self, inputs):
        return self.llama(inputs) + self.memory(inputs)


@pytest.mark.parametrize("strategy", ["upfront", "lazy"])
def test_every_kv_group_s_scratch_blocks_are_put_back(strategy):
    config = make_config(
        {
            "kv_cache.groups": [{"name": "window", "block_size": 2, "num_blocks": 90, "sliding_window": 5}],
            "capture.strategy": strategy,
        }
    )
    model = Hybrid(config)
    manager = CaptureManager(model, config, progress=False)
    group_scratch = {"window": range(60, 90)}
    before = _cached(model.memory.cache, 5)
    kv_before = _cached(model.llama.kv_cache, 6)
    manager.capture(scratch_blocks=SCRATCH, group_scratch_blocks=group_scratch)
    if strategy == "lazy":
        assert manager.capture_pending(scratch_blocks=SCRATCH, group_scratch_blocks=group_scratch) > 0
    assert manager.graphs
    assert torch.equal(model.memory.cache[2:], before[2:])  # slots 0, 1: the group's null block
    assert torch.equal(_all_but_null(model.llama.kv_cache), _all_but_null(kv_before))


def test_the_pass_uses_and_saves_only_the_scratch_blocks_its_probes_can_need():
    # T // bs + 2 R: the blocks the real tokens of a probe of the largest key span, each request starting anywhere
    shapes = {GraphKey(8, 8, False): GraphKey(8, 8, False), GraphKey(4, 4, False): GraphKey(4, 4, False)}
    assert probe_block_bound(shapes, shapes.__getitem__, 4) == 8 // 4 + 2 * 8
    manager = make_manager(make_config())
    before = _cached(manager.model.kv_cache, 7)
    many = list(range(1, 72))  # every block but the null block: the pass writes and saves at most 18
    manager.capture(scratch_blocks=many)
    assert torch.equal(_all_but_null(manager.model.kv_cache), _all_but_null(before))


def test_a_cache_kept_as_plain_module_attributes_is_put_back_too():
    from tests.test_recorded_statics import NanoModel, _bind_caches

    model = NanoModel()
    _bind_caches(model)
    manager = CaptureManager(model, make_config(), progress=False)
    kv = model.layers[0].attn.k_cache._base  # [layers, slots, width]: each layer's cache a view set as an attribute
    before = _cached(kv, 8)
    manager.capture(scratch_blocks=SCRATCH)
    assert torch.equal(kv[:, 4:], before[:, 4:])  # every slot but the null block's 0-3
