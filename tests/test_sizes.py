"""`graphcap.sizing.sizes`: the default schedule, validation, the padding table, expected waste."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes


def test_default_schedule_is_1_2_4_then_every_8_up_to_256():
    assert default_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]


def test_default_schedule_is_every_16_above_256():
    sizes = default_capture_sizes(512)
    assert sizes[: 3 + 32] == [1, 2, 4, *range(8, 257, 8)]
    assert sizes[3 + 32 :] == list(range(272, 513, 16))


@pytest.mark.parametrize(
    ("max_size", "tail"),
    [(1, [1]), (3, [1, 2, 3]), (100, [88, 96, 100]), (300, [272, 288, 300]), (257, [248, 256, 257])],
)
def test_default_schedule_always_ends_at_max_size(max_size, tail):
    sizes = default_capture_sizes(max_size)
    assert sizes[-len(tail) :] == tail
    assert max(sizes) == max_size


def test_default_schedule_with_uniform_query_len_4():
    assert default_capture_sizes(64, 4) == [4, 8, 16, 24, 32, 40, 48, 56, 64]


@given(q=st.integers(2, 8), multiple=st.integers(1, 200))
@settings(max_examples=60, deadline=None)
def test_default_schedule_sizes_are_multiples_of_uniform_query_len(q, multiple):
    max_size = q * multiple
    sizes = default_capture_sizes(max_size, q)
    assert all(size % q == 0 for size in sizes)
    assert sizes == sorted(set(sizes))
    assert sizes[0] == q
    assert sizes[-1] == max_size


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), r"max_size must be an integer >= 1; got 0"),
        ((-8,), r"max_size must be an integer >= 1; got -8"),
        ((True,), r"max_size must be an integer >= 1; got True"),
        ((8.0,), r"max_size must be an integer >= 1; got 8\.0"),
        ((8, 0), r"uniform_query_len must be an integer >= 1; got 0"),
        ((62, 4), r"max_size 62 is not a multiple of uniform_query_len 4; use 60 or 64"),
    ],
)
def test_default_schedule_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        default_capture_sizes(*args)


@pytest.mark.parametrize(
    ("sizes", "max_num_tokens", "match"),
    [
        ([], 8, r"capture sizes are empty"),
        ([0, 4], 8, r"capture size \[0\] must be an integer >= 1; got 0"),
        ([1, -2], 8, r"capture size \[1\] must be an integer >= 1; got -2"),
        ([4, 2], 8, r"must be ascending and unique; got \[4, 2\] \(\[0\]=4, \[1\]=2\)"),
        ([2, 4, 4], 8, r"must be ascending and unique; got \[2, 4, 4\] \(\[1\]=4, \[2\]=4\)"),
        ([4, 16], 8, r"capture size 16 exceeds max_num_tokens 8"),
        ([True, 2], 8, r"capture size \[0\] must be an integer >= 1; got True"),
        ([2.0, 4], 8, r"capture size \[0\] must be an integer >= 1; got 2\.0"),
        ([1, 2], 0, r"max_num_tokens must be an integer >= 1; got 0"),
        ([1, 2], True, r"max_num_tokens must be an integer >= 1; got True"),
    ],
)
def test_capture_sizes_refuses_invalid_schedules(sizes, max_num_tokens, match):
    with pytest.raises(ValueError, match=match):
        CaptureSizes(sizes, max_num_tokens)


@given(sizes=st.sets(st.integers(1, 300), min_size=1, max_size=40))
@settings(max_examples=80, deadline=None)
def test_pad_is_the_smallest_captured_size_that_holds_n(sizes):
    ordered = sorted(sizes)
    capture = CaptureSizes(ordered, 300)
    for n in range(capture.max_size + 6):
        expected = min((s for s in ordered if s >= n), default=None)
        assert capture.pad(n) == expected, n


def test_pad_of_zero_tokens_is_the_smallest_size():
    assert CaptureSizes([4, 8], 8).pad(0) == 4


def test_pad_refuses_negative_token_counts():
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0; got -1"):
        CaptureSizes([4, 8], 8).pad(-1)


def test_padding_table_lists_contiguous_ranges():
    assert CaptureSizes([1, 2, 4, 8], 8).padding_table() == [(1, 1, 1), (2, 2, 2), (3, 4, 4), (5, 8, 8)]


@given(sizes=st.sets(st.integers(1, 200), min_size=1, max_size=30))
@settings(max_examples=50, deadline=None)
def test_padding_table_agrees_with_pad(sizes):
    capture = CaptureSizes(sorted(sizes), 200)
    table = capture.padding_table()
    assert table[0][0] == 1 and table[-1][1] == capture.max_size
    for (first, last, padded), following in zip(table, [*table[1:], None]):
        assert all(capture.pad(n) == padded for n in range(first, last + 1))
        if following is not None:
            assert following[0] == last + 1


def test_expected_waste_with_every_count_equally_likely():
    # 1, 2, 3, 4 all pad to 4: 10 real tokens of 16 replayed.
    assert CaptureSizes([4], 4).expected_waste() == pytest.approx(6 / 16)


def test_expected_waste_over_a_histogram():
    sizes = CaptureSizes([4, 8], 8)
    assert sizes.expected_waste({3: 1.0}) == pytest.approx(1 / 4)
    assert sizes.expected_waste({3: 1.0, 8: 3.0}) == pytest.approx((4 - 3) / (4 + 24))


def test_expected_waste_ignores_counts_that_run_eagerly_or_are_empty():
    sizes = CaptureSizes([4, 8], 8)
    assert sizes.expected_waste({8: 1.0, 9: 50.0, 0: 7.0}) == 0.0
    assert sizes.expected_waste({}) == 0.0


def test_expected_waste_is_zero_when_every_count_is_captured():
    assert CaptureSizes(range(1, 17), 16).expected_waste() == 0.0


def test_capture_sizes_value_semantics():
    a, b = CaptureSizes([1, 2, 4], 8), CaptureSizes((1, 2, 4), 8)
    assert a == b and hash(a) == hash(b)
    assert a != CaptureSizes([1, 2, 4], 16)
    assert len(a) == 3 and list(a) == [1, 2, 4] and a.sizes == (1, 2, 4) and a.max_size == 4
    assert repr(a) == "CaptureSizes([1, 2, 4], max_num_tokens=8)"
