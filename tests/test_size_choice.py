"""`graphcap.sizing.choice`: sizes chosen from a traffic histogram, exact, within the config's bounds."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from graphcap import load_config
from graphcap.memory.estimate import estimate_memory
from graphcap.memory.graph_costs import graph_costs
from graphcap.sizing.choice import SizeConstraints, candidate_sizes, choose_sizes
from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes
from graphcap.testing.traffic import TRAFFIC_SHAPES, traffic_histogram

VLLM_LADDER = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # vLLM's default cudagraph_capture_sizes
UP_TO_512 = SizeConstraints(512)


def padded(sizes, histogram) -> float:
    """Padded tokens over the histogram's counts that `sizes` hold (the others run eagerly)."""
    return sum(w * min(s for s in sizes if s >= n) for n, w in histogram.items() if n <= max(sizes))


def waste(sizes, histogram) -> float:
    return CaptureSizes(sorted(sizes), max(sizes)).expected_waste(histogram)


histograms = st.dictionaries(st.integers(1, 512), st.integers(1, 1000), min_size=1, max_size=60)


def test_vllm_ladder_has_51_sizes_and_equals_the_default_schedule_at_512():
    assert len(VLLM_LADDER) == 51 and default_capture_sizes(512) == VLLM_LADDER


@given(
    histogram=st.dictionaries(st.integers(1, 13), st.integers(1, 20), min_size=1, max_size=9),
    max_graphs=st.integers(1, 5),
    q=st.sampled_from([1, 1, 2, 3]),
)
@settings(max_examples=150, deadline=None)
def test_choice_is_optimal_against_brute_force_over_every_size(histogram, max_graphs, q):
    choice = choose_sizes(histogram, max_graphs, SizeConstraints(15 - 15 % q, q))
    top = -(-max(histogram) // q) * q
    assert choice.sizes[-1] == top and len(choice.sizes) <= max_graphs
    assert all(s % q == 0 for s in choice.sizes) and list(choice.sizes) == sorted(set(choice.sizes))
    # Every schedule of multiples of q (not only observed counts) that holds the largest step.
    others = range(q, top, q)
    best = min(
        padded([*subset, top], histogram) for k in range(max_graphs) for subset in itertools.combinations(others, k)
    )
    assert padded(choice.sizes, histogram) == pytest.approx(best, rel=1e-12)


@given(histogram=histograms, max_graphs=st.integers(1, 51))
@settings(max_examples=80, deadline=None)
def test_choice_never_pads_more_than_the_first_sizes_of_the_vllm_ladder_on_the_steps_they_hold(histogram, max_graphs):
    prefix = VLLM_LADDER[:max_graphs]
    held = {n: w for n, w in histogram.items() if n <= prefix[-1]}
    assume(held)
    choice = choose_sizes(held, max_graphs, UP_TO_512)
    assert padded(choice.sizes, held) <= padded(prefix, held) * (1 + 1e-12)
    assert choice.waste <= waste(prefix, held) + 1e-12


@given(histogram=histograms, data=st.data())
@settings(max_examples=80, deadline=None)
def test_choice_never_pads_more_than_any_ladder_subset_that_holds_every_step(histogram, data):
    subset = data.draw(st.sets(st.sampled_from(VLLM_LADDER), max_size=50))
    subset = sorted(subset | {min(s for s in VLLM_LADDER if s >= max(histogram))})
    choice = choose_sizes(histogram, len(subset), UP_TO_512)
    assert padded(choice.sizes, histogram) <= padded(subset, histogram) * (1 + 1e-12)


@given(histogram=histograms, q=st.sampled_from([1, 2, 4]))
@settings(max_examples=60, deadline=None)
def test_choice_never_pads_more_than_the_default_schedule_with_as_many_graphs(histogram, q):
    schedule = default_capture_sizes(-(-max(histogram) // q) * q, q)
    choice = choose_sizes(histogram, len(schedule), SizeConstraints(512, q))
    assert padded(choice.sizes, histogram) <= padded(schedule, histogram) * (1 + 1e-12)


@pytest.mark.parametrize("shape", sorted(TRAFFIC_SHAPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_traffic_shapes_waste_at_most_5_percent_with_60_percent_of_the_vllm_graphs(shape, seed):
    histogram = traffic_histogram(shape, seed)
    assert max(histogram) <= 512
    choice = choose_sizes(histogram, 30, UP_TO_512)  # 60% of 51
    assert len(choice.sizes) <= 30 and not choice.eager
    assert choice.waste <= 0.05
    assert choice.waste == pytest.approx(waste(choice.sizes, histogram), abs=1e-12)
    same_count = choose_sizes(histogram, len(VLLM_LADDER), UP_TO_512)
    assert same_count.waste <= waste(VLLM_LADDER, histogram) + 1e-12


def test_traffic_shapes_cover_decode_and_chunked_prefill_steps():
    decode = traffic_histogram("decode-heavy", 0)
    mixed = traffic_histogram("chat-chunked", 0)
    steps = sum(decode.values())
    assert sum(w for n, w in decode.items() if n <= 256) / steps > 0.8  # mostly decode batches
    assert len([n for n in decode if n <= 256]) > 200  # spread over the batch sizes
    assert mixed[512] / sum(mixed.values()) > 0.3  # prefill chunks fill the 512-token budget
    assert traffic_histogram("chat-chunked", 0) == mixed  # a seed gives one histogram


def test_more_graphs_never_pad_more_and_stop_where_every_count_has_its_size():
    histogram = traffic_histogram("light-decode", 1)
    wastes = [choose_sizes(histogram, n, UP_TO_512).waste for n in (1, 2, 4, 8, 16, 30, 51, 1000)]
    assert wastes == sorted(wastes, reverse=True)
    assert choose_sizes(histogram, 10**6, UP_TO_512).sizes == tuple(sorted(histogram))


def test_steps_above_max_size_run_eagerly_and_the_largest_size_is_max_size_or_below():
    histogram = {1: 10, 30: 5, 70: 3, 100: 1}
    choice = choose_sizes(histogram, 3, SizeConstraints(64))
    assert choice.sizes == (1, 30) and choice.eager == {70: 3.0, 100: 1.0}
    assert choice.eager_reasons() == {"above_max_size": {70: 3.0, 100: 1.0}}
    assert choice.eager_share == pytest.approx(4 / 19)
    assert choice.pad(20) == 30 and choice.pad(70) is None
    covered = choose_sizes({1: 10, 30: 5, 63: 1}, 2, SizeConstraints(64))
    assert covered.sizes[-1] == 63 and not covered.eager and covered.eager_reasons() == {}


def test_uniform_query_len_rounds_sizes_to_whole_requests():
    choice = choose_sizes({3: 4, 5: 1, 9: 2, 16: 1}, 3, SizeConstraints(16, 4))
    assert all(s % 4 == 0 for s in choice.sizes) and choice.sizes[-1] == 16
    buckets = {size: (first, steps) for size, first, steps, _, _ in choice.buckets()}
    assert buckets[4] == (1, 4.0)


def test_decode_only_steps_that_are_not_whole_requests_run_eagerly():
    config = load_config("decode-only", {"capture.uniform_query_len": 2})
    constraints = SizeConstraints.from_config(config)
    assert constraints == SizeConstraints(64, 2, True)
    choice = choose_sizes({2: 5, 3: 4, 8: 2, 64: 1, 100: 1}, 4, constraints)
    assert choice.eager == {3: 4.0, 100: 1.0} and choice.sizes[-1] == 64
    assert choice.eager_reasons() == {"decode_only": {3: 4.0}, "above_max_size": {100: 1.0}}
    assert choice.pad(3) is None and choice.pad(7) is None and choice.pad(64) == 64


def test_constraints_from_configs():
    assert SizeConstraints.from_config(load_config()) == SizeConstraints(64, 1)
    assert SizeConstraints.from_config(load_config("spec-decode")) == SizeConstraints(128, 4)
    piecewise = load_config(None, {"capture.mode": "piecewise", "model.attention": "per_request"})
    assert SizeConstraints.from_config(piecewise).multiple_of == 1
    capped = load_config("decode-only", {"batching.max_num_seqs": 16})
    assert SizeConstraints.from_config(capped).max_size == 16  # a uniform key holds at most 16 requests
    with pytest.raises(ValueError, match=r"capture\.mode is none: no graph is captured"):
        SizeConstraints.from_config(load_config(None, {"capture.mode": "none"}))


@pytest.mark.parametrize(
    ("histogram", "max_graphs", "match"),
    [
        ({4: 1}, 0, r"max_graphs must be an integer >= 1; got 0"),
        ({4: 1}, True, r"max_graphs must be an integer >= 1; got True"),
        ({4: 1}, 2.0, r"max_graphs must be an integer >= 1; got 2\.0"),
        ({4: -1}, 2, r"histogram count of 4 tokens must be a finite number >= 0; got -1"),
        ({4: float("nan")}, 2, r"histogram count of 4 tokens must be a finite number >= 0; got nan"),
        ({0: 1}, 2, r"histogram token count must be an integer >= 1; got 0"),
        ({2.5: 1}, 2, r"histogram token count must be an integer >= 1; got 2\.5"),
        ({4: 0}, 2, r"histogram holds no step"),
        ({4: 1e308, 8: 1e308}, 2, r"sum to infinity; scale them down"),
        ({100: 3}, 2, r"the smallest token count 100 is above the largest allowed size 64"),
        ([4, 8], 2, r"histogram must map token counts to step counts; got list"),
    ],
)
def test_bad_arguments_raise_naming_the_value(histogram, max_graphs, match):
    with pytest.raises(ValueError, match=match):
        choose_sizes(histogram, max_graphs, SizeConstraints(64))


def test_bad_constraints_and_budget_arguments_raise():
    with pytest.raises(ValueError, match=r"SizeConstraints.max_size must be an integer >= 1; got 0"):
        SizeConstraints(0)
    with pytest.raises(ValueError, match=r"max_size 3 holds no multiple of 4"):
        SizeConstraints(3, 4)
    with pytest.raises(ValueError, match=r"memory_budget needs the graphs' costs"):
        choose_sizes({4: 1}, 2, SizeConstraints(64), memory_budget=1 << 30)
    with pytest.raises(ValueError, match=r"memory_budget must be bytes >= 1; got 0"):
        choose_sizes({4: 1}, 2, SizeConstraints(64), memory_budget=0)


CONFIGS = [
    (None, {}),
    ("llama3-8b-h200", {}),
    ("spec-decode", {}),
    ("decode-only", {}),
    (None, {"capture.mode": "full_and_piecewise", "model.attention": "per_request"}),
    (None, {"batching.max_num_seqs": 8}),  # the uniform key of 8 requests: a size or not
]


@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
@pytest.mark.parametrize("backend", ["cuda", "emulated"])
def test_graph_costs_add_up_to_the_memory_estimate_of_every_schedule(path, overrides, backend):
    config = load_config(path, overrides)
    constraints = SizeConstraints.from_config(config)
    rng = random.Random(0)
    histogram = {n: 1 for n in range(1, constraints.largest + 1)}
    candidates = candidate_sizes(histogram, constraints)
    costs = graph_costs(config, candidates, backend)
    for _ in range(25):
        sizes = sorted(rng.sample(candidates, rng.randint(1, min(12, len(candidates)))))
        capture = dataclasses.replace(config.capture, sizes=tuple(sizes), max_size=sizes[-1])
        estimate = estimate_memory(dataclasses.replace(config, capture=capture), backend=backend)
        assert costs.bytes_of(sizes) == estimate.parts["graphs"], sizes


def test_graph_costs_refuse_a_factory_model():
    base = load_config()
    factory = dataclasses.replace(base, model=dataclasses.replace(base.model, name=None, factory="pkg.module:build"))
    with pytest.raises(ValueError, match=r"model.factory pkg.module:build has no per-graph memory estimate"):
        graph_costs(factory, [1, 2], "cuda")


def _fits(config, sizes, backend, budget) -> int:
    capture = dataclasses.replace(config.capture, sizes=tuple(sizes), max_size=sizes[-1])
    graphs = estimate_memory(dataclasses.replace(config, capture=capture), backend=backend).parts["graphs"]
    assert graphs <= budget, (sizes, graphs, budget)
    return graphs


@pytest.mark.parametrize("backend", ["cuda", "emulated"])
@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.3, 0.1, 0.02])
def test_a_memory_budget_is_never_exceeded_by_the_estimate(backend, fraction):
    config = load_config("llama3-8b-h200")
    histogram = traffic_histogram("chat-chunked", 0)
    constraints = SizeConstraints.from_config(config)
    costs = graph_costs(config, candidate_sizes(histogram, constraints), backend)
    free = choose_sizes(histogram, 30, constraints, costs=costs)
    budget = int(free.memory * fraction)
    choice = choose_sizes(histogram, 30, constraints, costs=costs, memory_budget=budget)
    assert choice.memory == _fits(config, choice.sizes, backend, budget)
    assert len(choice.sizes) <= 30
    if fraction == 1.0:
        assert choice.sizes == free.sizes
    held = {n: w for n, w in histogram.items() if n <= choice.sizes[-1]}  # a budget costs padding
    assert padded(choice.sizes, held) >= padded(choose_sizes(held, 30, constraints).sizes, held) * (1 - 1e-12)
    if choice.eager:
        assert list(choice.eager_reasons()) == ["over_budget"] and min(choice.eager) > choice.sizes[-1]
        assert (
            costs.bytes_of([min(c for c in candidate_sizes(histogram, constraints) if c > choice.sizes[-1])]) > budget
        )


@given(
    histogram=st.dictionaries(st.integers(1, 64), st.integers(1, 50), min_size=1, max_size=30),
    max_graphs=st.integers(1, 12),
    fraction=st.floats(0.01, 1.0),
)
@settings(max_examples=60, deadline=None)
def test_an_emulated_budget_choice_fits_and_beats_every_unconstrained_optimum_that_fits(
    histogram, max_graphs, fraction
):
    # On the emulated backend every key keeps its output: sizes cost bytes of their own.
    config = load_config(None, {"device": "cpu"})
    constraints = SizeConstraints.from_config(config)
    costs = graph_costs(config, candidate_sizes(histogram, constraints), "emulated")
    budget = max(1, int(choose_sizes(histogram, max_graphs, constraints, costs=costs).memory * fraction))
    try:
        choice = choose_sizes(histogram, max_graphs, constraints, costs=costs, memory_budget=budget)
    except ValueError as exc:
        assert "is below the smallest graph's" in str(exc)
        return
    _fits(config, choice.sizes, "emulated", budget)
    assert len(choice.sizes) <= max_graphs
    held = {n: w for n, w in histogram.items() if n <= choice.sizes[-1]}
    for fewer in range(1, max_graphs + 1):
        optimum = choose_sizes(held, fewer, constraints, costs=costs)
        if optimum.memory <= budget:
            assert padded(choice.sizes, held) <= padded(optimum.sizes, held) * (1 + 1e-12)


@given(
    histogram=st.dictionaries(st.integers(1, 12), st.integers(1, 20), min_size=1, max_size=8),
    max_graphs=st.integers(1, 4),
    fraction=st.floats(0.05, 1.0),
)
@settings(max_examples=60, deadline=None)
def test_a_cuda_budget_choice_is_optimal_against_brute_force(histogram, max_graphs, fraction):
    # On CUDA the graphs share one pool sized by the largest key: the budget bounds the largest size.
    config = load_config(None, {"capture.max_size": 16, "device": "cuda"})
    constraints = SizeConstraints.from_config(config)
    costs = graph_costs(config, range(1, 17), "cuda")
    budget = max(1, int(costs.bytes_of([16]) * fraction))
    try:
        choice = choose_sizes(histogram, max_graphs, constraints, costs=costs, memory_budget=budget)
    except ValueError as exc:
        assert "is below the smallest graph's" in str(exc)
        assert all(costs.bytes_of([n]) > budget for n in histogram)
        return
    _fits(config, choice.sizes, "cuda", budget)
    # The most steps replayed first (the largest size that fits), then the fewest padded tokens.
    top = max(n for n in histogram if costs.bytes_of([n]) <= budget and n <= max(histogram))
    assert choice.sizes[-1] == top
    held = {n: w for n, w in histogram.items() if n <= top}
    best = min(
        padded([*s, top], held)
        for k in range(max_graphs)
        for s in itertools.combinations(range(1, top), k)
        if costs.bytes_of([*s, top]) <= budget
    )
    assert padded(choice.sizes, held) == pytest.approx(best, rel=1e-12)


def test_a_budget_below_the_smallest_graph_names_it():
    config = load_config()
    costs = graph_costs(config, [1, 8], "emulated")
    with pytest.raises(ValueError, match=r"memory budget 100 bytes is below the smallest graph's \d+ bytes \(size 1"):
        choose_sizes({1: 3, 8: 1}, 2, SizeConstraints(64), costs=costs, memory_budget=100)
    with pytest.raises(ValueError, match=r"costs do not price size 4"):
        choose_sizes({4: 3, 8: 1}, 2, SizeConstraints(64), costs=costs)
