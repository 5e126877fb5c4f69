"""`CollectiveLedger` in one process: what a failing rank issues from its partners' published descriptors.

A one-rank gloo world (the collectives complete alone) and a hash store in which the test writes a
partner's stream as a peer would: the rank issues each collective naming it from the index it did not
reach, stops at the partner's end, and stops (logging why, within `failure_timeout`) at what it
cannot follow. The descriptors round-trip through JSON for any nesting of tensors and values.
"""

from __future__ import annotations

import datetime
import json
import logging

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from graphcap.distributed import ledger as ledger_module
from graphcap.distributed.ledger import CollectiveLedger


@pytest.fixture(scope="module")
def world():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield store
    finally:
        dist.destroy_process_group()


def _descriptor(shape=(2, 3), ranks=(0, 1), op="all_reduce", args=None, segment=0) -> bytes:
    tensor = {"tensor": list(shape), "dtype": "float32"}
    entry = {"segment": segment, "op": op, "overload": "default", "args": args or [tensor, "sum", "0"],
             "kwargs": {"dict": {}}, "ranks": list(ranks)}  # fmt: skip
    return (json.dumps(entry) + "\n").encode()


def _end(how: str = "end", segment: int = 0) -> bytes:
    return json.dumps({"segment": segment, "end": how}).encode()


def _failing_segment(ledger: CollectiveLedger, before: int) -> None:
    """A segment whose forward issues `before` all-reduces on the world group, then raises."""

    def forward(inputs) -> None:
        for _ in range(before):
            out = torch.ops._c10d_functional.all_reduce(torch.ones(2, 3), "sum", "0")
            torch.ops._c10d_functional.wait_tensor(out)
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"), ledger.segment():
        ledger.wrap(forward)(None)


def _ledger(world, timeout: float = 30.0) -> tuple[CollectiveLedger, str]:
    ledger = CollectiveLedger(0, [0, 1], timeout, "cpu", store=world)
    return ledger, ledger._store_prefix


def test_a_failing_rank_issues_the_partners_collectives_from_the_one_it_did_not_reach_to_the_partners_end(world):
    ledger, prefix = _ledger(world)
    for index in range(3):  # the partner's key: three all-reduces, then its end
        world.set(f"{prefix}/1/{index}", _descriptor(shape=(2, 3 + index)))
    world.set(f"{prefix}/1/3", _end())
    world.set(f"{prefix}/1/4", _descriptor(segment=-1))  # left by an earlier segment: never read
    _failing_segment(ledger, before=1)
    assert (ledger.completed, ledger.placeholders, ledger.published) == (1, 2, 1)
    # This rank's own stream: its one descriptor, then "fail"; the next segment reuses the keys.
    assert json.loads(world.get(f"{prefix}/0/0"))["op"] == "all_reduce"
    assert json.loads(world.get(f"{prefix}/0/1")) == {"segment": 0, "end": "fail"}
    with ledger.segment():
        pass
    assert json.loads(world.get(f"{prefix}/0/0")) == {"segment": 1, "end": "end"}


def test_an_entry_an_earlier_segment_left_is_read_again_until_the_partner_overwrites_it(world):
    ledger, prefix = _ledger(world)
    with ledger.segment():  # segment 0 closes on both ranks
        pass
    stale = [_end(segment=0), _end(segment=0)]  # what the partner's key holds before it reaches segment 1

    class Partner:
        """The store, whose partner key turns to segment 1's entry after two reads of segment 0's."""

        def wait(self, keys, timeout):
            world.wait(keys, timeout)

        def get(self, key):
            if key.endswith("/1/0") and stale:
                return stale.pop()
            return world.get(key)

    world.set(f"{prefix}/1/0", _descriptor(segment=1))
    world.set(f"{prefix}/1/1", _end(segment=1))
    ledger._store = _Prefixed(Partner(), prefix, ledger._store)
    _failing_segment(ledger, before=0)
    assert (ledger.completed, ledger.placeholders) == (1, 1) and not stale


def test_a_partner_that_failed_before_this_rank_ends_the_following_at_its_failure(world):
    ledger, prefix = _ledger(world)
    world.set(f"{prefix}/1/0", _descriptor())
    world.set(f"{prefix}/1/1", _end("fail"))
    _failing_segment(ledger, before=2)
    assert (ledger.completed, ledger.placeholders) == (0, 0)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (_descriptor(ranks=(1, 2)), "does not name rank 0: its group holds ranks outside"),
        (
            _descriptor(op="all_to_all_single", args=[{"tensor": [4], "dtype": "float32"}, [1, 3], [2, 2], "0"]),
            "all_to_all_single with per-rank split sizes",
        ),
    ],
)
def test_what_the_rank_cannot_follow_stops_it_with_the_reason_logged(world, caplog, entry, why):
    ledger, prefix = _ledger(world)
    world.set(f"{prefix}/1/0", entry)
    with caplog.at_level(logging.WARNING, logger="graphcap"):
        _failing_segment(ledger, before=0)
    assert why in caplog.text and ledger.completed == 0


def test_a_partner_that_publishes_nothing_stops_the_following_at_failure_timeout(world, caplog):
    ledger, _ = _ledger(world, timeout=0.2)  # nothing is ever published: the wait ends at the bound
    with caplog.at_level(logging.WARNING, logger="graphcap"):
        _failing_segment(ledger, before=0)
    assert "was not published in time" in caplog.text and ledger.placeholders == 0


def test_a_segment_that_fails_in_a_collective_does_not_follow(world):
    ledger, prefix = _ledger(world)
    with pytest.raises(RuntimeError, match="Gloo"), ledger.segment():
        raise RuntimeError("[gloo] Gloo connection closed by peer")
    assert json.loads(world.get(f"{prefix}/0/0")) == {"segment": 0, "end": "fail"} and ledger.placeholders == 0


class _Prefixed:
    """Reads through `reader` (with the prefix), writes through `writer` (a PrefixStore)."""

    def __init__(self, reader, prefix: str, writer) -> None:
        self.reader, self.prefix, self.writer = reader, prefix, writer

    def wait(self, keys, timeout):
        self.reader.wait([f"{self.prefix}/{key}" for key in keys], timeout)

    def get(self, key):
        return self.reader.get(f"{self.prefix}/{key}")

    def set(self, key, value):
        self.writer.set(key, value)


_VALUES = st.recursive(
    st.one_of(
        st.integers(-(2**31), 2**31),
        st.text(max_size=8),
        st.booleans(),
        st.none(),
        st.tuples(st.lists(st.integers(0, 4), max_size=3), st.sampled_from(["float32", "bfloat16", "int64"])).map(
            lambda spec: torch.empty(spec[0], dtype=getattr(torch, spec[1]))
        ),
    ),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=8,
)


@given(_VALUES)
def test_a_descriptor_round_trips_through_json_as_zero_tensors_of_its_shapes_and_the_values(value):
    decoded = ledger_module._decode(json.loads(json.dumps(ledger_module._encode(value))), torch.device("cpu"))

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and (a.shape, a.dtype) == (b.shape, b.dtype) and not b.any()
        if isinstance(a, (list, tuple)):
            return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b and type(a) is type(b)

    assert same(value, decoded)
