"""`graphcap.sizing.axes`: sizes chosen for traffic with key axes count a graph per (size, combination),
place every step as dispatch does, and report the waste per axis value, in sample and held out."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import load_config
from graphcap.keys import KeyRegistry
from graphcap.memory.estimate import estimate_memory
from graphcap.memory.graph_costs import graph_costs
from graphcap.sizing.axes import (
    AxisPlan,
    axis_values_held_out,
    choose_axis_values,
    choose_with_axes,
    slot_waste,
    value_waste,
)
from graphcap.sizing.choice import SizeConstraints, candidate_sizes
from graphcap.sizing.held_out import choose_held_out, choose_way, split_steps
from graphcap.sizing.sizes import CaptureSizes
from graphcap.testing.traffic import TRAFFIC_SHAPES, adapter_steps, traffic_histogram

LORA = {"lora": (0, 1, 2, 4, 8)}


@pytest.mark.parametrize("shape", list(TRAFFIC_SHAPES))
def test_adapter_steps_are_the_traffic_histograms_steps_with_a_lora_value_each(shape):
    steps = adapter_steps(shape, seed=4, num_steps=1500)
    tokens = {}
    for (n, axes), w in steps.items():
        assert [name for name, _ in axes] == ["lora"] and 0 <= axes[0][1] <= 16
        tokens[n] = tokens.get(n, 0) + w
    assert tokens == dict(traffic_histogram(shape, seed=4, num_steps=1500))
    assert len({axes for _, axes in steps}) > 3 and steps == adapter_steps(shape, seed=4, num_steps=1500)


# -- brute force: every step placed from first principles -------------------------------------------------------


def brute_place(plan_axes, listed, sizes, n, axes):
    """(size, combination) a step replays, or None, recomputed without the registry's tables."""
    if n > sizes[-1]:
        return None
    padded = []
    for name, value in axes:
        above = [v for v in plan_axes[name] if v >= value]
        if not above:
            return None
        padded.append(min(above))
    names = list(plan_axes)
    combos = listed or [dict(zip(names, values)) for values in itertools.product(*plan_axes.values())]
    holders = [c for c in combos if all(c[name] >= v for name, v in zip(names, padded))]
    if not holders:
        return None
    best = min(holders, key=lambda c: (sum(plan_axes[k].index(c[k]) for k in names), tuple(c[k] for k in names)))
    return min(s for s in sizes if s >= n), tuple((k, best[k]) for k in names)


def brute_rows(plan_axes, listed, sizes, steps):
    """{(axis, value): (steps, token waste, slot waste)} by brute force (None where undefined)."""
    total = sum(steps.values())
    sums = {(name, v): [0.0, 0.0, 0.0, 0.0, 0.0] for name, values in plan_axes.items() for v in values}
    for (n, axes), w in steps.items():
        placed = brute_place(plan_axes, listed, sizes, n, axes)
        if placed is None:
            continue
        size, combo = placed
        for (name, own), (_, value) in zip(axes, combo):
            for i, x in enumerate((w, n * w, size * w, own * w, value * w)):
                sums[name, value][i] += x
    return {
        k: (s / total, (p - r) / p if s else None, (sl - u) / sl if s and sl else None)
        for k, (s, r, p, u, sl) in sums.items()
    }


PLANS = st.tuples(
    st.dictionaries(
        st.sampled_from(["lora", "ubatch"]),
        st.lists(st.integers(0, 6), min_size=1, max_size=3, unique=True).map(lambda v: tuple(sorted(v))),
        min_size=1,
        max_size=2,
    ),
    st.randoms(use_true_random=False),
)


def plan_of(setup):
    axes, rng = setup
    every = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    listed = rng.sample(every, rng.randint(1, len(every))) if rng.random() < 0.5 else []
    return axes, listed, AxisPlan(axes, listed)


def steps_for(data, plan: AxisPlan, max_tokens: int = 40):
    values = {name: st.integers(0, vs[-1] + 2) for name, vs in plan.values.items()}
    step = st.tuples(st.integers(1, max_tokens), st.fixed_dictionaries(values))
    drawn = data.draw(st.lists(st.tuples(step, st.integers(1, 6)), min_size=1, max_size=25))
    out = {}
    for (n, axes), w in drawn:
        key = plan.step(n, axes)
        out[key] = out.get(key, 0) + w
    return out


@settings(max_examples=150, deadline=None)
@given(
    setup=PLANS,
    data=st.data(),
    max_graphs=st.integers(1, 30),
    q=st.sampled_from([1, 1, 2]),
    mode=st.sampled_from(["full", "full_decode_only"]),
)
def test_the_plan_never_exceeds_max_graphs_and_every_step_goes_where_dispatch_sends_it(
    setup, data, max_graphs, q, mode
):
    axes, listed, plan = plan_of(setup)
    steps = steps_for(data, plan)
    bound = SizeConstraints(32, q, uniform_only=mode == "full_decode_only")
    try:
        chosen = choose_with_axes(steps, max_graphs, bound, plan)
    except ValueError as exc:  # the only refusals: too few graphs for the combinations, or nothing replays
        assert max_graphs < plan.num_combinations or "no observed step can replay" in str(exc)
        return
    assert chosen.num_graphs == len(chosen.sizes) * plan.num_combinations <= max_graphs
    keys = KeyRegistry(CaptureSizes(chosen.sizes, chosen.sizes[-1]), mode, q, 64, axes=axes, combinations=listed)
    keys.captured.update(keys.planned)
    for step in steps:
        n, values = step
        placed, reason = chosen.place(step)
        uniform = mode == "full_decode_only" and n % q == 0  # a decode step of n / q requests, else mixed
        _, key, dispatched = keys.dispatch(n, n // q if uniform else 1, uniform, dict(values))
        if placed is None:
            assert reason and dispatched == reason, (step, reason, dispatched)
        else:
            assert (reason, dispatched) == ("", "") and key in keys.planned
            assert (key.num_tokens, key.axes) == placed == brute_place(axes, listed, chosen.sizes, n, values)


@settings(max_examples=120, deadline=None)
@given(setup=PLANS, data=st.data(), max_graphs=st.integers(8, 30))
def test_the_reported_waste_per_axis_value_equals_a_brute_force_recount(setup, data, max_graphs):
    axes, listed, plan = plan_of(setup)
    steps = steps_for(data, plan)
    try:
        chosen = choose_with_axes(steps, max_graphs, SizeConstraints(40), plan)
    except ValueError:
        return
    expect = brute_rows(axes, listed, chosen.sizes, steps)
    rows = chosen.values()
    assert [(r.axis, r.value) for r in rows] == list(expect)
    for row in rows:
        share, tokens, slots = expect[row.axis, row.value]
        assert row.share == pytest.approx(share, abs=1e-12)
        assert row.token_waste == pytest.approx(tokens, abs=1e-12)
        assert row.slot_waste == pytest.approx(slots, abs=1e-12)
    # the total token waste: over every replayed step, as the chooser's own
    replayed = [(brute_place(axes, listed, chosen.sizes, n, a), n, w) for (n, a), w in steps.items()]
    real = sum(n * w for p, n, w in replayed if p)
    padded = sum(p[0] * w for p, n, w in replayed if p)
    assert chosen.held.choice.waste == pytest.approx((padded - real) / padded if padded else 0.0, abs=1e-12)
    eager = sum(w for p, _, w in replayed if p is None) / sum(steps.values())
    assert chosen.eager_share == pytest.approx(eager, abs=1e-12)


@pytest.mark.parametrize("shape", list(TRAFFIC_SHAPES))
def test_on_traffic_shapes_the_held_out_rows_are_each_directions_recount_averaged(shape):
    steps = adapter_steps(shape, seed=3, num_steps=2000)
    plan, bound = AxisPlan(LORA), SizeConstraints(512)
    chosen = choose_with_axes(steps, 30, bound, plan)
    assert len(chosen.sizes) <= 6 and chosen.num_graphs <= 30
    first, second = split_steps(steps)
    scored = []
    for chosen_on, scored_on in ((first, second), (second, first)):
        tokens = {}
        for (n, a), w in chosen_on.items():
            if a[0][1] <= 8:
                tokens[n] = tokens.get(n, 0) + w
        sizes = choose_way(chosen.held.way, tokens, 6, bound, {"costs": None, "memory_budget": None}).sizes
        scored.append(brute_rows(LORA, [], sizes, scored_on))
    for row in chosen.held_out_values:
        a, b = (s[row.axis, row.value] for s in scored)
        assert row.share == pytest.approx((a[0] + b[0]) / 2)
        assert row.token_waste == pytest.approx((a[1] + b[1]) / 2)
        assert row.slot_waste == (None if row.value == 0 else pytest.approx((a[2] + b[2]) / 2))
    # the lora values above 8 run eagerly under the axis's name, and choose no size
    above = {step for step in steps if step[1][0][1] > 8}
    assert set(chosen.eager_reasons().get("above_max_axis.lora", {})) <= above


@pytest.mark.parametrize("shape", list(TRAFFIC_SHAPES))
def test_without_axes_the_choice_and_its_scores_are_choose_held_outs(shape):
    histogram = traffic_histogram(shape, seed=1, num_steps=3000)
    steps = {(n, ()): w for n, w in histogram.items()}
    chosen = choose_with_axes(steps, 30, SizeConstraints(512), AxisPlan())
    alone = choose_held_out(histogram, 30, SizeConstraints(512))
    assert chosen.sizes == alone.choice.sizes and chosen.held.way == alone.way
    assert chosen.held.held_out == alone.held_out and chosen.held.choice.waste == alone.choice.waste
    assert chosen.num_graphs == len(chosen.sizes) and chosen.values() == []


def test_a_step_stating_no_axis_is_at_each_axiss_smallest_value_and_lora_3_pads_one_slot_of_4():
    plan = AxisPlan({"lora": (1, 4)})
    assert plan.step(8) == (8, (("lora", 1),))
    steps = {plan.step(8, {"lora": 3}): 10, plan.step(8): 10}
    (low, high) = value_waste(steps, (8,), plan, SizeConstraints(8))
    assert (low.value, low.share, low.slot_waste) == (1, 0.5, 0.0)
    assert (high.value, high.share, high.slot_waste) == (4, 0.5, 0.25)


def test_max_graphs_counts_graphs_the_same_schedule_with_five_lora_values_takes_five_times_as_many():
    histogram = traffic_histogram("decode-heavy", seed=0, num_steps=1500)
    steps = {(n, (("lora", 1),)): w for n, w in histogram.items()}
    with_axes = choose_with_axes(steps, 50, SizeConstraints(512), AxisPlan(LORA))
    without = choose_held_out(histogram, 10, SizeConstraints(512))
    assert with_axes.sizes == without.choice.sizes and with_axes.num_graphs == 50


@pytest.mark.parametrize(
    ("steps", "max_graphs", "match"),
    [
        ({(4, (("lora", 1),)): 1}, 4, r"max_graphs 4 is below the 5 planned combinations of key axes"),
        ({(4, (("lora", 1),)): 1}, 0, r"max_graphs must be an integer >= 1; got 0"),
        ({(4, (("lora", 9),)): 1}, 5, r"no observed step can replay: every step's axis values are above"),
        ({(4, (("ubatch", 1),)): 1}, 5, r"must give every axis of \('lora',\) an integer >= 0"),
        ({(4, (("lora", -1),)): 1}, 5, r"must give every axis of \('lora',\) an integer >= 0"),
        ({(0, (("lora", 1),)): 1}, 5, r"step token count must be an integer >= 1; got 0"),
        ({4: 1}, 5, r"a step is \(tokens, \(\(axis, value\), \.\.\.\)\)"),
        ({(4, (("lora", 1),)): -2}, 5, r"must be a finite number >= 0; got -2"),
        ({(4, (("lora", 1),)): 0}, 5, r"steps hold no step"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value_and_the_fix(steps, max_graphs, match):
    with pytest.raises(ValueError, match=match):
        choose_with_axes(steps, max_graphs, SizeConstraints(64), AxisPlan(LORA))


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ({"adapters": 2}, r"axis 'adapters' is not in capture.axes \(its axes: lora\)"),
        ({"lora": -1}, r"axis lora value must be an integer >= 0; got -1"),
        ({"lora": 2.5}, r"axis lora value must be an integer >= 0; got 2.5"),
    ],
)
def test_a_bad_step_is_refused_naming_the_axis(axes, match):
    with pytest.raises(ValueError, match=match):
        AxisPlan(LORA).step(4, axes)


@pytest.mark.parametrize("backend", ["cuda", "emulated"])
def test_the_memory_budgets_costs_count_every_combinations_graph(backend):
    base = load_config("tiny-cpu-ci", {"capture.max_size": 8})
    config = load_config("tiny-cpu-ci", {"capture.axes": {"lora": [0, 2, 4]}})
    constraints = SizeConstraints.from_config(config)
    candidates = candidate_sizes(dict.fromkeys(range(1, 9), 1), constraints)
    costs, alone = graph_costs(config, candidates, backend), graph_costs(base, candidates, backend)
    for sizes in ([8], [1, 8], [2, 4, 8], [1, 2, 4, 8]):
        capture = dataclasses.replace(config.capture, sizes=tuple(sizes), max_size=sizes[-1])
        estimate = estimate_memory(dataclasses.replace(config, capture=capture), backend=backend)
        assert costs.bytes_of(sizes) == estimate.parts["graphs"], sizes
        if backend == "emulated":  # each combination keeps its own outputs: three graphs per key
            assert costs.bytes_of(sizes) == 3 * alone.bytes_of(sizes)


# -- choosing the axis values too (`--choose-axes`) -------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    values=st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True).map(lambda v: tuple(sorted(v))),
    seen=st.dictionaries(st.integers(0, 11), st.integers(1, 20), min_size=1, max_size=8),
)
def test_chosen_axis_values_pad_the_fewest_slots_against_brute_force_and_plan_no_more_combinations(values, seen):
    plan = AxisPlan({"lora": values})
    steps = {(4, (("lora", v),)): w for v, w in seen.items()}
    within = [v for v in seen if v <= values[-1]]
    if not within:
        with pytest.raises(ValueError, match=r"no observed step has a lora value within capture.axes.lora's largest"):
            choose_axis_values(steps, plan)
        return
    chosen = choose_axis_values(steps, plan)["lora"]
    assert len(chosen) <= len(values) and chosen[-1] == max(within) and list(chosen) == sorted(set(chosen))

    def padded(vs):
        return sum(w * min(x for x in vs if x >= v) for v, w in seen.items() if v <= values[-1])

    best = min(
        padded([*subset, max(within)])
        for k in range(len(values))
        for subset in itertools.combinations(range(max(within)), k)
    )
    assert padded(chosen) == best <= padded(values)
    waste = slot_waste(steps, {"lora": chosen})["lora"]
    assert waste <= slot_waste(steps, plan.values)["lora"] + 1e-12


def test_axis_values_held_out_are_chosen_on_one_half_and_scored_on_the_other():
    steps = adapter_steps("light-decode", seed=5, num_steps=800)
    plan = AxisPlan(LORA)
    first, second = split_steps(steps)
    scores = [slot_waste(b, choose_axis_values(a, plan))["lora"] for a, b in ((first, second), (second, first))]
    assert axis_values_held_out(steps, plan) == {"lora": pytest.approx(sum(scores) / 2)}
    assert axis_values_held_out({(4, (("lora", 1),)): 0.5, (8, (("lora", 2),)): 1.0}, plan) is None  # weights


def test_axis_values_are_not_chosen_over_listed_combinations():
    plan = AxisPlan({"lora": (0, 4), "ubatch": (1, 2)}, [{"lora": 0, "ubatch": 1}])
    with pytest.raises(ValueError, match=r"capture.axis_combinations lists combinations by value"):
        choose_axis_values({(4, (("lora", 1), ("ubatch", 1))): 1}, plan)
