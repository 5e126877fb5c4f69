"""`capture.max_padding_factor`: a step its graph would pad past the factor runs eagerly (`over_padding`).

The rules: a step of n tokens replays a graph of P tokens only when P <= factor * n; otherwise it runs
eagerly, counted under `over_padding` (a uniform step whose own uniform key is within the factor but
not captured keeps that key's reason); null turns the guard off; the factor is validated strictly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphcap import ConfigError, StepBatch
from graphcap.config.sections import DEFAULT_MAX_PADDING_FACTOR
from graphcap.keys import EAGER_REASONS, GraphKey, KeyRegistry, Mode
from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes
from graphcap.testing import make_config, make_manager

SPARSE = {"capture.sizes": [1, 16], "capture.max_size": 16}


def _registry(sizes, factor, mode="full", max_num_seqs=8) -> KeyRegistry:
    keys = KeyRegistry(CaptureSizes(sizes, max(sizes)), mode, 1, max_num_seqs, None, factor)
    for key in keys.planned:
        keys.mark_captured(key)
    return keys


def _prefill(num_tokens: int) -> StepBatch:
    return StepBatch([num_tokens], [num_tokens], np.arange(num_tokens) % 100, np.array([[1, 2, 3, 4]]))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True).map(sorted),
    factor=st.one_of(st.none(), st.floats(1.0, 8.0)),
    mode=st.sampled_from(["full", "piecewise", "full_and_piecewise", "full_decode_only"]),
    num_tokens=st.integers(1, 64),
    uniform=st.booleans(),
)
@example(sizes=[2], factor=1.0, mode="full_decode_only", num_tokens=1, uniform=True)  # no mixed key to fall to
def test_a_step_replays_only_a_graph_within_the_factor(sizes, factor, mode, num_tokens, uniform):
    keys = _registry(sizes, factor, mode)
    num_reqs = min(num_tokens, 8) if uniform else 1
    uniform = uniform and num_tokens <= 8
    dispatch = keys.dispatch(num_tokens, num_reqs if uniform else 1, uniform)
    unguarded = _registry(sizes, None, mode).dispatch(num_tokens, num_reqs if uniform else 1, uniform)
    if dispatch.mode is Mode.EAGER:
        assert dispatch.reason in EAGER_REASONS
        if dispatch.reason == "over_padding":  # the guard decided: without it the step replays, padded past it
            assert factor is not None and unguarded.mode is not Mode.EAGER
            assert unguarded.key.num_tokens > factor * num_tokens
        else:
            assert dispatch == unguarded
    else:
        assert factor is None or dispatch.key.num_tokens <= factor * num_tokens
        assert dispatch == unguarded  # within the factor the guard changes nothing


def test_the_default_factor_never_triggers_on_the_default_schedule():
    sizes = default_capture_sizes(512)
    assert max(CaptureSizes(sizes, 512).pad(n) / n for n in range(1, 513)) < DEFAULT_MAX_PADDING_FACTOR


def test_a_step_padded_past_the_factor_runs_eagerly_and_is_counted_as_over_padding():
    manager = make_manager(make_config({**SPARSE, "capture.max_padding_factor": 2}))
    manager.capture()
    small = _prefill(2)  # 16 tokens for 2: 8x
    out = manager.execute(small).clone()
    assert manager.stats.eager["over_padding"] == 1 and not manager.stats.graph_hits
    torch.testing.assert_close(out, manager.eager(small))
    large = _prefill(9)  # 16 for 9: within 2x, the canary: the same graph replays
    out = manager.execute(large).clone()
    assert manager.last_key == GraphKey(16, 8, False) and sum(manager.stats.graph_hits.values()) == 1
    torch.testing.assert_close(out, manager.eager(large))
    assert "over_padding" in manager.stats.as_dict()["eager"]


def test_without_a_factor_the_same_step_replays_padded():
    manager = make_manager(make_config({**SPARSE, "capture.max_padding_factor": None}))
    manager.capture()
    manager.execute(_prefill(2))
    assert manager.last_key == GraphKey(16, 8, False) and manager.stats.eager["over_padding"] == 0


def test_a_pending_uniform_key_within_the_factor_keeps_its_reason():
    keys = KeyRegistry(CaptureSizes([1, 8, 16], 16), "full", 1, 8, None, 2.0)
    keys.mark_captured(GraphKey(16, 8, False))  # the mixed key of 16 is captured; the uniform key of 8 is not
    dispatch = keys.dispatch(5, 5, True)  # 8 for 5 is within 2x; 16 for 5 is not
    assert (dispatch.mode, dispatch.reason) == (Mode.EAGER, "not_captured")
    assert keys.demand[GraphKey(8, 8, True)] == 1


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.5, r"capture.max_padding_factor: .*>= 1"),
        ("2", r"capture.max_padding_factor: expected a number or null; got '2'"),
        (True, r"capture.max_padding_factor: expected a number or null; got True"),
        (float("inf"), r"capture.max_padding_factor: must be finite"),
        (float("nan"), r"capture.max_padding_factor: expected a number or null; got nan"),
    ],
)
def test_a_bad_factor_is_refused_naming_the_key(value, match):
    with pytest.raises(ConfigError, match=match):
        make_config({"capture.max_padding_factor": value})


def test_the_factor_is_in_the_default_config():
    assert make_config().capture.max_padding_factor == DEFAULT_MAX_PADDING_FACTOR
