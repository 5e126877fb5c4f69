"""Sizes chosen from traffic, scored on steps they were not chosen from (`graphcap.sizing.held_out`).

The rules: the steps split into two halves that add up to the histogram, each step to either half by a
seeded draw (the same halves every run; a count seen once lands in one half); each way of choosing (`traffic`, `ladder`) is chosen on one half and
scored on the other; the way kept has the lowest held-out waste, so it is never above the ladder's at the
same number of graphs; histograms of relative weights are not split.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.sizing.choice import SizeConstraints, choose_sizes
from graphcap.sizing.held_out import choose_held_out, held_out_waste, ladder_sizes, split_steps

BOUND = SizeConstraints(64)
HISTOGRAMS = st.dictionaries(st.integers(1, 64), st.integers(1, 30), min_size=2, max_size=30)


@settings(max_examples=80, deadline=None)
@given(histogram=HISTOGRAMS)
def test_the_halves_add_up_to_the_histogram_and_are_the_same_every_run(histogram):
    halves = split_steps(histogram)
    assert halves == split_steps(histogram)
    if halves is None:  # every step drawn into one half
        return
    first, second = halves
    assert first and second
    for n, steps in histogram.items():
        assert first.get(n, 0) + second.get(n, 0) == steps
        if steps == 1:
            assert (n in first) != (n in second)


def test_a_count_seen_once_lands_in_one_half_and_a_huge_count_splits_near_evenly():
    first, second = split_steps({n: 1 for n in range(1, 41)} | {64: 10**9})
    assert all((n in first) != (n in second) for n in range(1, 41))
    assert abs(first[64] - 5 * 10**8) < 10**6 and first[64] + second[64] == 10**9


def test_relative_weights_are_not_split_and_the_choice_is_the_traffic_one():
    histogram = {1: 0.5, 8: 1.25, 64: 0.25}
    assert split_steps(histogram) is None
    held = choose_held_out(histogram, 2, BOUND)
    assert held.held_out is None and held.way == "traffic"
    assert held.choice.sizes == choose_sizes(histogram, 2, BOUND).sizes


@settings(max_examples=60, deadline=None)
@given(histogram=HISTOGRAMS, max_graphs=st.integers(1, 12))
def test_the_way_kept_has_the_lowest_held_out_waste_never_above_the_ladders(histogram, max_graphs):
    held = choose_held_out(histogram, max_graphs, BOUND)
    if held.held_out is None:
        return
    assert held.held_out[held.way] == min(held.held_out.values())
    assert held.held_out[held.way] <= held.held_out["ladder"]
    assert len(held.choice.sizes) <= max_graphs
    if held.way == "ladder":
        assert set(held.choice.sizes) <= set(ladder_sizes(BOUND))


def test_scattered_singletons_keep_the_ladder_and_dense_traffic_keeps_its_own_sizes():
    scattered = {12: 1, 11: 1, 47: 1, 22: 1, 40: 1, 33: 1}  # every count seen once
    held = choose_held_out(scattered, 4, BOUND)
    assert held.way == "ladder" and held.held_out["ladder"] < held.held_out["traffic"]
    dense = {1: 40, 2: 20, 3: 10, 8: 20, 20: 8, 64: 2}  # the same counts in both halves
    held = choose_held_out(dense, 3, BOUND)
    assert held.way == "traffic" and held.choice.sizes == (3, 20, 64)


def test_held_out_steps_above_every_size_run_eagerly_and_waste_nothing():
    assert held_out_waste((4, 8), {2: 1, 8: 1, 40: 5}, BOUND) == (4 - 2) / 12
