"""The memory budget's reservation in a pool, over any sequence of what happens to a pool: it always sits in
the handle later captures go to (or nothing is reserved), the allocator never holds a use of a handle no
graph or reservation needs, and no capture meets the allocator's `use_count > 0` assertion. The allocator's
pool bookkeeping is simulated with PyTorch's rules (tests/backends/fake_allocator.py)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.backends import GraphPool
from graphcap.backends.cuda import SMALL_SEGMENT, reservation_layout
from tests.backends.fake_allocator import FakeAllocator

MiB = 1 << 20


@given(st.integers(min_value=1, max_value=1 << 42))
def test_a_reservation_is_laid_out_within_its_budget_with_some_small_segments(num_bytes):
    large, segments = reservation_layout(num_bytes)
    assert large >= 0 and 0 <= segments <= 32 and large + segments * SMALL_SEGMENT == num_bytes
    assert segments >= 1 or num_bytes < SMALL_SEGMENT  # every budget of 2 MiB or more fills small blocks
    assert segments * SMALL_SEGMENT <= max(num_bytes // 64, SMALL_SEGMENT)


def _pool(allocator: FakeAllocator) -> GraphPool:
    handles = itertools.count(1)

    def reserve(handle, num_bytes):
        allocator.begin(0, handle)  # the holder graph's capture into the handle
        allocator.end(0, handle)
        return (lambda: allocator.release(0, handle)), num_bytes

    return GraphPool(None, lambda: (0, next(handles)), empty_cache=allocator.empty_cache, reserve=reserve)


STEPS = st.lists(
    st.sampled_from(["reserve_small", "reserve_large", "capture", "release_graph", "rotate", "give_back"]),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(STEPS)
def test_the_reservation_follows_the_pool_through_any_sequence(steps):
    allocator = FakeAllocator()
    pool = _pool(allocator)
    graphs: list = []  # handles of live graphs
    for step in steps:
        if step.startswith("reserve"):
            num_bytes = 64 * MiB if step == "reserve_small" else 256 * MiB
            held = pool.reserved_bytes or 0
            pool.reserve(num_bytes)
            assert pool.reserved_bytes == max(held, num_bytes)
        elif step == "capture":  # what a backend's capture does: record to the handle, count the graph live
            allocator.begin(0, pool.handle)  # asserts use_count > 0 for a known handle
            allocator.end(0, pool.handle)
            graphs.append(pool.hold())
        elif step == "release_graph" and graphs:
            handle = graphs.pop(0)
            allocator.release(0, handle)
            pool.drop(handle)
        elif step == "rotate":  # a failed capture
            pool.rotate()
        elif step == "give_back":  # release() of every graph's manager
            pool.release_reservation()
        if pool.reservation is not None:
            assert pool.reservation.handle == pool.handle  # where the next capture allocates
        holders = {pool.reservation.handle: len(pool.reservation.holders)} if pool.reservation else {}
        for handle, uses in allocator.use_count.items():
            assert uses == graphs.count(handle) + holders.get(handle, 0)  # no use held for nothing
            assert uses > 0 or handle != pool.handle  # the next capture never meets the use_count assert
    for handle in list(graphs):
        allocator.release(0, handle)
        pool.drop(handle)
    pool.release_reservation()
    pool.rotate()
    allocator.empty_cache()
    assert not allocator.use_count  # nothing left held
