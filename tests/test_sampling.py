"""Live steps sampled (`checks.sample_every: N`): every Nth replay is compared with an eager run of the same batch.

Capture-time verification passes for each model here; a fault that shows only later (a kernel reading
a wrong slice at live padded shapes, a host plan gone stale) is named by the first sampled step after it
(`ReplayMismatchError`, with the key and the step). The eager run leaves nothing in the KV cache: a sampled
step leaves it bit-identical to the same step unsampled, and a passing model is never flagged.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphcap
from graphcap import CaptureManager, ConfigError, ReplayMismatchError, StepBatch
from graphcap.checks.sampling import StepSampler, locate
from graphcap.models import build_model
from graphcap.testing import make_config, make_manager
from tests.tools import TOOLS

sys.path.insert(0, str(TOOLS))  # tools/campaign/: the fault models, shared with the campaign

from campaign.live_faults import StalePlan, WrongSlice


def _batch(num_reqs: int, seed: int, max_query: int = 1) -> StepBatch:
    rng = np.random.default_rng(seed)
    q = rng.integers(1, max_query + 1, num_reqs)
    seq = q + rng.integers(0, 12, num_reqs)
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    return StepBatch(q, seq, rng.integers(0, 128, int(q.sum())), table)


def _manager(model, every: int = 1, **overrides) -> CaptureManager:
    config = make_config({"checks.sample_every": every, **overrides})
    manager = CaptureManager(model(config), config, progress=False)
    report = manager.capture()
    assert all(record.verified for record in report.captured), "capture-time verification passes"
    return manager


@pytest.mark.parametrize("where", ["output", "kv"])
def test_a_wrong_slice_read_at_live_shapes_is_named_by_the_first_sampled_step(where):
    manager = _manager(lambda config: WrongSlice(config, where))
    batch = _batch(3, 0)  # 3 decode tokens: replayed padded to 4
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    manager.model.bug.fill_(1)  # the fault, after capture: an in-place write the guard accepts
    what = "its output" if where == "output" else r"the KV slots its tokens write in 'model\.cache'"
    with pytest.raises(
        ReplayMismatchError, match=rf"replayed step 2 \(key uniform\(tokens=4, reqs=4\)\).*{what}"
    ) as info:
        manager.execute(batch)
    assert (info.value.step, info.value.key) == (2, manager.last_key)
    assert isinstance(info.value, graphcap.CaptureError)


def test_canary_without_sampling_the_wrong_slice_is_silent():
    manager = _manager(lambda config: WrongSlice(config, "output"), every=0)
    manager.model.bug.fill_(1)
    batch = _batch(3, 0)
    replayed = manager.execute(batch).clone()
    assert not torch.allclose(replayed, manager.eager(batch)), "the hazard: a replay that differs, with no error"


def test_sampling_every_third_step_checks_only_those():
    manager = _manager(lambda config: WrongSlice(config, "output"), every=3)
    manager.model.bug.fill_(1)
    manager.execute(_batch(3, 1))
    manager.execute(_batch(3, 2))  # steps 1 and 2 are not sampled: wrong, and silent
    with pytest.raises(ReplayMismatchError, match="replayed step 3 "):
        manager.execute(_batch(3, 3))


def test_a_host_plan_that_goes_stale_after_capture_is_named_by_sampling():
    manager = _manager(StalePlan)
    batch = _batch(3, 5, max_query=2)
    out = manager.execute(batch).clone()
    assert manager.last_key in manager.graphs
    torch.testing.assert_close(out, manager.eager(batch))
    manager.model.tuning["scale"] = 0.5
    with pytest.raises(ReplayMismatchError, match=r"replayed step 2 \(key mixed.*its output.*prepare\(\)"):
        manager.execute(batch)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_sampled_step_leaves_the_kv_cache_and_outputs_bit_identical_to_an_unsampled_one(mode):
    overrides = {"capture.mode": mode, "model.attention": "per_request"} if mode == "piecewise" else {}
    sampled, plain = _manager(build_model, every=1, **overrides), _manager(build_model, every=0, **overrides)
    for seed in range(6):
        batch = _batch(1 + seed % 7, seed, max_query=2)
        torch.testing.assert_close(sampled.execute(batch).clone(), plain.execute(batch).clone(), rtol=0, atol=0)
        assert torch.equal(sampled.model.kv_cache, plain.model.kv_cache)
    assert sampled._sampler.checked == sampled._sampler.replays > 0


def test_the_eager_run_puts_back_the_slots_it_wrote_before_the_replay(monkeypatch):
    manager = _manager(build_model)
    cache = manager.model.kv_cache
    writes = []
    real_eager = StepSampler.eager

    def watched(self, inputs, forward, real, caches):
        expected = real_eager(self, inputs, forward, real, caches)
        writes.append(cache.clone())  # after the eager run, before the replay
        return expected

    before = cache.clone()
    monkeypatch.setattr(StepSampler, "eager", watched)
    manager.execute(_batch(3, 4))
    assert torch.equal(writes[0], before), "the eager run's writes are undone before the replay"
    assert not torch.equal(cache, before), "the replay wrote its slots"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(0, 2**16)), min_size=1, max_size=6))
def test_a_passing_model_is_never_flagged(shared_manager, steps):
    for num_reqs, max_query, seed in steps:
        batch = _batch(num_reqs, seed, max_query=max_query)
        torch.testing.assert_close(shared_manager.execute(batch).clone(), shared_manager.eager(batch))


@pytest.fixture(scope="module")
def shared_manager():
    return _manager(build_model, every=1, **{"capture.mode": "full"})


def test_locate_finds_block_major_and_slot_major_caches_and_skips_parameters():
    tensors = {
        "blocks": torch.zeros(2, 9, 3, 4),  # [layers, blocks + 1, heads, block_size]
        "slots": torch.zeros(33, 5),  # 8 blocks of 4 slots, a pad sink
        "weight": torch.nn.Parameter(torch.zeros(8, 4)),
        "other": torch.zeros(7, 3),
    }
    found = {cache.name: cache for cache in locate(tensors, [(None, 4, 8)])}
    assert set(found) == {"blocks", "slots"}
    assert found["blocks"].by_block and tuple(found["blocks"].view.shape) == (9, 4, 2, 3)
    assert not found["slots"].by_block and tuple(found["slots"].view.shape) == (33, 5)


@pytest.mark.parametrize(("value", "match"), [(-1, ">= 0"), (True, "bool"), ("10", "str")])
def test_sample_every_is_validated_naming_the_key(value, match):
    with pytest.raises(ConfigError, match=rf"checks\.sample_every.*{match}"):
        make_config({"checks.sample_every": value})


def test_sampling_is_off_by_default():
    manager = make_manager(make_config())
    assert manager.config.checks.sample_every == 0 and manager._sampler is None
