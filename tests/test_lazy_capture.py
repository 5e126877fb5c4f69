"""Lazy capture: the manager serves from its first step and `capture_pending` captures in idle time.

The rules: a step whose key has no graph runs eagerly (reason `pending`) and equals eager; `capture()`
captures nothing; `capture_pending` takes the most-used pending key first (before any traffic, the
upfront order), verifies each key as upfront capture does, follows `capture.on_error`, writes no live
KV block, and after `release()`/`resize_kv()` every key is pending again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap import CaptureError, CaptureManager, StepBatch
from graphcap.models import build_model
from graphcap.testing import FaultyModel, fill_batch, make_config, make_manager

LAZY = {"capture.strategy": "lazy"}


def _decode(num_reqs: int, seed: int = 0) -> StepBatch:
    """`num_reqs` decode requests with distinct blocks (block ids from 1)."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(2, 20, num_reqs)
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    return StepBatch(np.ones(num_reqs, dtype=np.int32), seq, rng.integers(0, 128, num_reqs), table)


def test_a_lazy_manager_serves_before_any_capture_and_counts_steps_as_pending():
    manager = make_manager(make_config(LAZY))
    batch = _decode(3)
    out = manager.execute(batch).clone()
    torch.testing.assert_close(out, manager.eager(batch))
    assert manager.stats.eager["pending"] == 1
    assert not manager.graphs


def test_lazy_capture_captures_nothing_and_its_report_lists_the_pending_keys():
    manager = make_manager(make_config(LAZY))
    report = manager.capture()
    assert report.records == [] and not manager.graphs
    assert report.pending == [str(key) for key in manager.registry.capture_order()]
    assert report.to_dict()["pending"] == report.pending
    assert "pending (6)" in report.summary()


def test_capture_pending_takes_the_most_used_key_first_then_replays_it():
    manager = make_manager(make_config(LAZY))
    for seed in range(3):
        manager.execute(_decode(3, seed))  # 3 decode tokens: the uniform key of 4 tokens
    manager.execute(_decode(7))  # once: the uniform key of 8 tokens
    assert manager.capture_pending(max_keys=1) == 1
    (key,) = manager.graphs
    assert (key.num_tokens, key.num_reqs, key.uniform) == (4, 4, True)
    assert manager._lazy.records[key].verified
    batch = _decode(3, 9)
    out = manager.execute(batch).clone()
    assert manager.last_key == key and manager.stats.graph_hits[key] == 1
    torch.testing.assert_close(out, manager.eager(batch))


def test_before_any_traffic_capture_pending_follows_the_upfront_order():
    manager = make_manager(make_config(LAZY))
    order = manager.registry.capture_order()
    assert manager.capture_pending(max_keys=2) == 2
    assert set(manager.graphs) == set(order[:2])


MODES = {
    "full": {},
    "piecewise": {"capture.mode": "piecewise", "model.attention": "per_request"},
    "full_and_piecewise": {"capture.mode": "full_and_piecewise", "model.attention": "per_request"},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_capture_pending_captures_every_key_once_then_returns_zero(mode):
    manager = make_manager(make_config({**LAZY, **MODES[mode]}))
    assert manager.capture_pending(max_seconds=0) == 0  # no time: nothing is started
    assert manager.capture_pending(max_keys=0) == 0
    assert manager.capture_pending() == len(manager.registry.planned)
    assert set(manager.graphs) == set(manager.registry.planned)
    assert all(record.verified for record in manager._lazy.records.values())
    assert manager.capture_pending() == 0
    batch = _decode(3)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    assert sum(manager.stats.graph_hits.values()) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_seconds": -1}, r"max_seconds=\.\.\.\) must be None \(no limit\) or seconds >= 0; got -1"),
        ({"max_seconds": "1"}, r"got '1'"),
        ({"max_seconds": True}, r"got True"),
        ({"max_seconds": float("nan")}, r"got nan"),
        ({"max_keys": -1}, r"max_keys=\.\.\.\) must be None \(no limit\) or an integer >= 0; got -1"),
        ({"max_keys": 1.5}, r"got 1.5"),
    ],
)
def test_bad_limits_are_refused_naming_the_argument(kwargs, match):
    manager = make_manager(make_config(LAZY))
    with pytest.raises(ValueError, match=match):
        manager.capture_pending(**kwargs)
    assert not manager.graphs


def test_bad_scratch_blocks_are_refused_before_anything_is_captured():
    manager = make_manager(make_config(LAZY))
    with pytest.raises(ValueError, match="scratch_blocks holds 0"):
        manager.capture_pending(scratch_blocks=[0])
    assert not manager.graphs


def test_a_failing_key_is_skipped_under_on_error_skip_and_its_steps_run_eagerly():
    config = make_config(LAZY, capture__on_error="skip")
    model = FaultyModel(build_model(config))
    manager = CaptureManager(model, config, progress=False)
    model.arm(4, lambda: RuntimeError("injected fault"))
    assert manager.capture_pending() == 4  # of 6 keys, the two of 4 tokens fail
    model.disarm()
    assert {key.num_tokens for key in manager.registry.skipped} == {4}
    assert "injected fault" in next(iter(manager.registry.skipped.values()))
    batch = _decode(3)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    assert manager.stats.eager["skipped"] == 1
    assert manager.capture_pending() == 0  # a skipped key is not pending


def test_a_failing_key_raises_under_on_error_raise_and_keeps_the_graphs_captured_before():
    config = make_config(LAZY)
    model = FaultyModel(build_model(config))
    manager = CaptureManager(model, config, progress=False)
    assert manager.capture_pending(max_keys=2) == 2  # the two keys of 8 tokens
    model.arm(4, lambda: RuntimeError("injected fault"))
    with pytest.raises(CaptureError, match=r"capturing uniform\(tokens=4, reqs=4\) failed: RuntimeError: injected"):
        manager.capture_pending()
    model.disarm()
    assert {key.num_tokens for key in manager.graphs} == {8}
    assert manager.capture_pending() == 4  # the failed key stayed pending


@pytest.mark.parametrize("how", ["release", "resize_kv", "capture"])
def test_after_release_resize_or_capture_every_key_is_pending_again(how):
    manager = make_manager(make_config(LAZY))
    manager.capture_pending()
    if how == "release":
        manager.release()
    elif how == "resize_kv":
        manager.resize_kv(64)
    else:
        manager.capture()
    assert not manager.graphs
    assert manager.registry.pending() == manager.registry.capture_order()
    assert manager.capture_pending() == len(manager.registry.planned)


def test_capture_pending_leaves_every_live_kv_block_but_the_null_and_scratch_blocks_bit_identical():
    config = make_config(LAZY)
    manager = make_manager(config)
    cache = manager.model.kv_cache
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(7)))
    before = cache.clone()
    scratch = list(range(40, 72))
    manager.capture_pending(scratch_blocks=scratch)
    differs = (before != cache).any(dim=5).any(dim=4).any(dim=2).any(dim=1).any(dim=0)
    changed = set(torch.nonzero(differs).flatten().tolist())
    assert changed <= {0}, "the scratch blocks the verification batches wrote are put back (capture.restore)"


def test_upfront_manager_still_captures_everything_in_capture():
    manager = make_manager(make_config())
    report = manager.capture()
    assert report.pending == [] and len(manager.graphs) == len(manager.registry.planned)
    assert manager.capture_pending() == 0


_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(0, 10), st.integers(1, 8), st.integers(0, 2**16)),
        st.tuples(st.just("capture"), st.integers(0, 2)),
        st.tuples(st.just("release")),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_STEPS)
def test_any_interleaving_of_steps_and_capture_pending_equals_eager_and_replays_only_verified_keys(steps):
    config = make_config(LAZY)
    manager = make_manager(config)
    keys = manager.registry.planned
    verified: set = set()
    for action in steps:
        if action[0] == "capture":
            manager.capture_pending(max_keys=action[1])
            verified |= {k for k, record in manager._lazy.records.items() if record.verified}
            continue
        if action[0] == "release":
            manager.release()
            verified.clear()
            continue
        _, which, num_reqs, seed = action
        key = keys[which % len(keys)]
        batch = fill_batch(key, config, seed, num_reqs=min(num_reqs, key.num_reqs, key.num_tokens))
        hits = sum(manager.stats.graph_hits.values())
        out = manager.execute(batch)
        out = out.clone()
        if sum(manager.stats.graph_hits.values()) > hits:  # it replayed a graph
            assert manager.last_key in verified, f"{manager.last_key} replayed before it was captured and verified"
        torch.testing.assert_close(out, manager.eager(batch))
