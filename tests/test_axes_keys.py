"""Key axes (`capture.axes`) in the config, the keys, the batch and dispatch (no capture).

Every token key is planned at every combination of axis values; a step pads each axis to the smallest
captured value at or above its own, and runs eagerly (`above_max_axis.NAME`) above the largest. The
property tests hold the capture-key == dispatch-key invariant: every planned key is what some valid step
dispatches to, and every valid step dispatches to a planned key that holds it or eagerly with a named reason.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import BatchError, GraphKey, StepBatch
from graphcap.config import ConfigError
from graphcap.keys import EAGER_REASONS, KeyRegistry, Mode, reason_kind
from graphcap.sizing.sizes import CaptureSizes
from graphcap.testing import make_config


def registry(
    axes=None, *, mode="full", sizes=(1, 2, 4, 8), q=1, max_num_seqs=8, captured=True, combinations=()
) -> KeyRegistry:
    keys = KeyRegistry(CaptureSizes(sizes, 64), mode, q, max_num_seqs, 64, axes=axes, combinations=combinations)
    if captured:
        for key in keys.planned:
            keys.mark_captured(key)
    return keys


# -- config -------------------------------------------------------------------------------------------


def test_the_config_keeps_each_axis_as_ascending_values_and_writes_them_back_as_lists():
    config = make_config({"capture.axes": {"lora": [0, 1, 2, 4], "ubatch": [1, 2]}})
    assert dict(config.capture.axes) == {"lora": (0, 1, 2, 4), "ubatch": (1, 2)}
    assert config.to_dict()["capture"]["axes"] == {"lora": [0, 1, 2, 4], "ubatch": [1, 2]}
    assert dict(make_config().capture.axes) == {}  # default: no axes


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ({"lora": [2, 1]}, r"capture\.axes\.lora: must be ascending and unique; got \[2, 1\].*write \[1, 2\]"),
        ({"lora": [1, 1]}, r"capture\.axes\.lora: must be ascending and unique.*write \[1\]"),
        ({"lora": []}, r"capture\.axes\.lora: is empty; give at least one value"),
        ({"lora": [-1, 2]}, r"capture\.axes\.lora: \[0\] is -1; axis values lie in \[0, 65536\]"),
        ({"lora": [True]}, r"capture\.axes\.lora: \[0\] must be an integer; got True"),
        ({"lora": "1,2"}, r"capture\.axes\.lora: expected a list of integers"),
        ({"lo-ra": [1]}, r"capture\.axes\.lo-ra: 'lo-ra' is not an axis name: use a Python identifier"),
        ({"tokens": [1]}, r"capture\.axes\.tokens: 'tokens' is reserved.*rename the axis"),
        ({f"a{i}": [1] for i in range(5)}, r"capture\.axes: names 5 axes .* at most 4"),
        ({"a": list(range(64)), "b": list(range(32))}, r"capture\.axes: plans 64 \(a\) x 32 \(b\) = 2048 combinations"),
        ([1, 2], r"capture\.axes: expected a mapping"),
    ],
)
def test_a_bad_axis_names_its_dotted_key_and_the_fix(axes, match):
    with pytest.raises(ConfigError, match=match):
        make_config({"capture.axes": axes})


# -- keys ---------------------------------------------------------------------------------------------


def test_a_key_without_axes_is_built_and_printed_as_before_and_one_with_axes_prints_them():
    assert GraphKey(4, 4, True) == GraphKey(4, 4, True, ()) and str(GraphKey(4, 4, True)) == "uniform(tokens=4, reqs=4)"
    key = GraphKey(4, 4, True, (("lora", 2), ("ubatch", 1)))
    assert str(key) == "uniform(tokens=4, reqs=4, lora=2, ubatch=1)" and key.base == GraphKey(4, 4, True)
    assert str(GraphKey(8, None, False, (("lora", 0),))) == "piecewise(tokens=8, lora=0)"
    assert len({key, GraphKey(4, 4, True, (("lora", 2), ("ubatch", 1))), key.base}) == 2  # hashable by value
    with pytest.raises(AttributeError):
        key.axes = ()


def test_every_token_key_is_planned_at_every_combination_largest_first():
    keys = registry({"lora": (0, 2), "ubatch": (1, 2)}, sizes=(2, 4))
    plain = registry(sizes=(2, 4))
    assert len(keys.planned) == 4 * len(plain.planned)
    assert {key.base for key in keys.planned} == set(plain.planned)
    order = keys.capture_order()
    combos = list(dict.fromkeys(k.axes for k in order if k.num_tokens == 4))
    assert combos == [
        (("lora", 2), ("ubatch", 2)),
        (("lora", 2), ("ubatch", 1)),
        (("lora", 0), ("ubatch", 2)),
        (("lora", 0), ("ubatch", 1)),
    ]
    assert {k.num_tokens for k in order[:8]} == {4}  # the largest token count first, every combination
    assert keys.capture_shape(GraphKey(4, None, False, (("lora", 2),))).axes == (("lora", 2),)


def test_dispatch_pads_each_axis_to_the_smallest_captured_value_at_or_above_it():
    keys = registry({"lora": (0, 1, 2, 4, 8)})
    for value, padded in [(0, 0), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)]:
        mode, key, reason = keys.dispatch(3, 3, True, {"lora": value})
        assert (mode, key, reason) == (Mode.FULL, GraphKey(4, 4, True, (("lora", padded),)), ""), value
    assert keys.dispatch(3, 3, True).key.axes == (("lora", 0),)  # a missing axis is its smallest value
    assert keys.dispatch(3, 3, True, {}).key.axes == (("lora", 0),)


def test_above_the_largest_value_the_step_runs_eagerly_under_a_reason_naming_the_axis():
    keys = registry({"lora": (0, 2), "ubatch": (1, 2)})
    mode, key, reason = keys.dispatch(3, 2, False, {"lora": 1, "ubatch": 3})
    assert (mode, reason) == (Mode.EAGER, "above_max_axis.ubatch")
    assert key == GraphKey(3, 2, False, (("lora", 1), ("ubatch", 3)))  # the step's own values, unpadded
    assert reason_kind(reason) in EAGER_REASONS and "capture.axes" in EAGER_REASONS[reason_kind(reason)]
    assert keys.dispatch(99, 2, False, {"lora": 9}).reason == "above_max_size"  # tokens are judged first


def test_an_axis_the_config_does_not_plan_is_refused_naming_it_and_the_planned_axes():
    with pytest.raises(BatchError, match=r"axes names 'lroa', which capture\.axes does not plan \(its axes: lora\)"):
        registry({"lora": (0, 2)}).dispatch(2, 2, True, {"lroa": 1})
    with pytest.raises(BatchError, match=r"axes names 'lora', which capture\.axes does not plan \(its axes: none\)"):
        registry().dispatch(2, 2, True, {"lora": 1})


def test_a_negative_value_given_to_the_registry_directly_is_refused():
    with pytest.raises(BatchError, match=r"axes\['lora'\] is -1; axis values are >= 0"):
        registry({"lora": (0, 2)}).dispatch(2, 2, True, {"lora": -1})


def test_a_key_of_one_combination_not_captured_runs_eagerly_while_the_others_replay():
    keys = registry({"lora": (0, 2)}, captured=False)
    for key in keys.planned:
        if dict(key.axes)["lora"] == 0:
            keys.mark_captured(key)
    assert keys.dispatch(2, 2, True, {"lora": 0}).mode is Mode.FULL
    mode, key, reason = keys.dispatch(2, 2, True, {"lora": 1})
    assert (mode, reason) == (Mode.EAGER, "not_captured") and keys.demand[GraphKey(2, 2, True, (("lora", 2),))] == 1


# -- the batch ----------------------------------------------------------------------------------------


def test_a_batch_keeps_its_axes_read_only_and_prints_them():
    values = {"lora": np.int64(3)}
    batch = StepBatch([1, 1], [2, 2], axes=values)
    values["lora"] = 7  # the caller's dict is not the batch's
    assert dict(batch.axes) == {"lora": 3} and type(batch.axes["lora"]) is int and "axes={'lora': 3}" in repr(batch)
    with pytest.raises(TypeError):
        batch.axes["lora"] = 1
    assert dict(StepBatch([1], [1]).axes) == {}


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ([("lora", 1)], r"axes must map axis names \(capture\.axes\) to integers; got list"),
        ({"lora": -1}, r"axes\['lora'\] is -1; axis values lie in \[0, 2147483647\]"),
        ({"lora": 1.5}, r"axes\['lora'\] must be an integer; got 1\.5"),
        ({"lora": True}, r"axes\['lora'\] must be an integer; got True"),
        ({1: 2}, r"axes names must be strings"),
    ],
)
def test_a_bad_axes_value_is_refused_naming_it(axes, match):
    with pytest.raises(BatchError, match=match):
        StepBatch([1], [1], axes=axes)


# -- the invariant: capture key == dispatch key ------------------------------------------------------

AXES = st.dictionaries(
    st.sampled_from(["lora", "ubatch", "draft"]),
    st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True).map(sorted),
    max_size=2,
)
SETUPS = st.tuples(
    st.sampled_from(["full", "full_decode_only", "piecewise", "full_and_piecewise"]),
    st.lists(st.integers(1, 48), min_size=1, max_size=5, unique=True).map(sorted),
    st.sampled_from([1, 2, 3]),
    st.integers(1, 12),
    AXES,
    st.randoms(use_true_random=False),
)


def planned_registry(setup) -> KeyRegistry:
    """A registry of the setup, every combination planned or (half the time) a random subset listed."""
    mode, sizes, q, max_num_seqs, axes, rng = setup
    every = [dict(zip(axes, values)) for values in itertools.product(*axes.values())] if axes else []
    listed = rng.sample(every, rng.randint(1, len(every))) if every and rng.random() < 0.5 else []
    return registry(axes, mode=mode, sizes=tuple(sizes), q=q, max_num_seqs=max_num_seqs, combinations=listed)


@settings(max_examples=150, deadline=None)
@given(SETUPS)
def test_every_planned_key_is_the_dispatch_key_of_a_valid_step(setup):
    keys = planned_registry(setup)
    for key in keys.planned:
        num_reqs = keys.capture_shape(key).num_reqs if key.piecewise else key.num_reqs
        q = keys.uniform_query_len
        assert 1 <= num_reqs <= min(key.num_tokens, keys.max_num_seqs)  # a valid step has these counts
        assert not key.uniform or key.num_tokens == num_reqs * q
        mode, got, reason = keys.dispatch(key.num_tokens, num_reqs, key.uniform, dict(key.axes))
        assert (got, reason) == (key, ""), (key, got, reason)
        assert mode is keys.mode_of(key)


@settings(max_examples=150, deadline=None)
@given(SETUPS, st.data())
def test_every_valid_step_dispatches_to_a_planned_key_that_holds_it_or_eagerly_with_a_named_reason(setup, data):
    keys = planned_registry(setup)
    captured = data.draw(st.sets(st.sampled_from(keys.planned))) if keys.planned else set()
    keys.captured = set(captured)
    q, top = keys.uniform_query_len, keys.sizes.max_size + 2
    num_reqs = data.draw(st.integers(1, keys.max_num_seqs))
    uniform = data.draw(st.booleans())
    num_tokens = num_reqs * q if uniform else data.draw(st.integers(num_reqs, max(num_reqs, top)))
    values = {name: data.draw(st.integers(0, vals[-1] + 2)) for name, vals in keys.axes.items()}
    mode, key, reason = keys.dispatch(num_tokens, num_reqs, uniform, values)
    if mode is Mode.EAGER:
        assert reason_kind(reason) in EAGER_REASONS, reason
        assert key == GraphKey(num_tokens, num_reqs, False, tuple(values.items()))
        if reason_kind(reason) == "above_max_axis":
            name = reason.partition(".")[2]
            assert values[name] > keys.axes[name][-1]
        if reason == "no_axis_combination":  # no planned combination holds the step's values
            assert not any(all(dict(k.axes)[n] >= v for n, v in values.items()) for k in keys.planned)
        return
    assert reason == ""
    assert_holds(keys, key, num_tokens, num_reqs, uniform, values)


def assert_holds(keys: KeyRegistry, key: GraphKey, num_tokens: int, num_reqs: int, uniform: bool, values) -> None:
    """`key` is a captured planned key that holds the step, each axis at its smallest captured value >= the step's."""
    assert key in keys.planned and key in keys.captured
    assert key.num_tokens >= num_tokens and (key.num_reqs is None or key.num_reqs >= num_reqs)
    assert not key.uniform or uniform
    padded = {name: min(v for v in keys.axes[name] if v >= values[name]) for name in keys.axes}
    for name, value in key.axes:  # each axis at least its padded value: exactly it when that combination is planned
        assert value >= padded[name], (key, values)
    if key._replace(axes=tuple(padded.items())) in keys.planned:
        assert dict(key.axes) == padded, (key, values)


def test_the_check_fails_for_a_step_dispatched_to_a_key_built_for_another_value():
    """Canary: a stale padding table (3 adapters -> the graph of 2 slots) is what `assert_holds` refuses."""
    keys = registry({"lora": (0, 2, 4)})
    assert_holds(keys, keys.dispatch(2, 2, True, {"lora": 3}).key, 2, 2, True, {"lora": 3})
    keys._axis_pad = ([0, 2, 2, 2, 4],)
    key = keys.dispatch(2, 2, True, {"lora": 3}).key
    with pytest.raises(AssertionError):
        assert_holds(keys, key, 2, 2, True, {"lora": 3})


def test_listed_combinations_are_planned_alone_and_a_step_replays_the_one_with_fewest_padded_slots():
    listed = [{"lora": 4, "ubatch": 2}, {"lora": 0, "ubatch": 1}, {"lora": 2, "ubatch": 1}]
    keys = registry({"lora": (0, 2, 4), "ubatch": (1, 2)}, combinations=listed)
    assert {k.axes for k in keys.planned} == {tuple(c.items()) for c in listed}
    assert dict(keys.dispatch(2, 2, True, {"lora": 1}).key.axes) == {"lora": 2, "ubatch": 1}
    assert dict(keys.dispatch(2, 2, True, {"lora": 1, "ubatch": 2}).key.axes) == {"lora": 4, "ubatch": 2}
    assert dict(keys.dispatch(2, 2, True).key.axes) == {"lora": 0, "ubatch": 1}


def test_a_step_no_listed_combination_holds_runs_eagerly_under_its_reason():
    keys = registry({"lora": (0, 2), "ubatch": (1, 2)}, combinations=[{"lora": 2, "ubatch": 1}])
    mode, key, reason = keys.dispatch(2, 2, True, {"ubatch": 2})
    assert (mode, reason) == (Mode.EAGER, "no_axis_combination") and reason in EAGER_REASONS
    assert key.axes == (("lora", 0), ("ubatch", 2))


@pytest.mark.parametrize(
    ("listed", "match"),
    [
        ([{"lora": 2}], r"capture\.axis_combinations\[0\]: gives no value for ubatch"),
        ([{"lora": 2, "ubatch": 1, "x": 1}], r"capture\.axis_combinations\[0\]: names 'x', not an axis"),
        ([{"lora": 3, "ubatch": 1}], r"capture\.axis_combinations\[0\]: lora 3 is not a value of capture\.axes\.lora"),
        ([{"lora": True, "ubatch": 1}], r"capture\.axis_combinations\[0\]: lora True is not a value"),
        ([{"lora": 2, "ubatch": 1}, {"ubatch": 1, "lora": 2}], r"\[1\]: repeats capture\.axis_combinations\[0\]"),
        ("x", r"capture\.axis_combinations: expected a list of mappings"),
    ],
)
def test_a_bad_combination_names_its_entry_and_the_fix(listed, match):
    with pytest.raises(ConfigError, match=match):
        make_config({"capture.axes": {"lora": [0, 2], "ubatch": [1, 2]}, "capture.axis_combinations": listed})


def test_combinations_without_axes_are_refused():
    with pytest.raises(ConfigError, match=r"capture\.axis_combinations: lists combinations but capture\.axes names no"):
        make_config({"capture.axis_combinations": [{"lora": 1}]})
