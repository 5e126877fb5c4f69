"""Lazy capture: which keys still wait for a graph, and the order `capture_pending` takes them in.

With `capture.strategy: lazy` the manager serves from its first step: a step whose key has no
graph yet runs eagerly (reason `pending`), and the engine hands graphcap idle time between steps
with `CaptureManager.capture_pending(max_seconds)`. Each call captures pending keys one at a time,
each verified exactly as upfront capture verifies it (one pass of the `Capturer` per key), the key that
paid most first: the most traffic seen for it (eager steps that wanted it, `KeyRegistry.demand`,
plus replays before a release, `StepStats.graph_hits`), ties and the time before any traffic in
the order upfront capture uses (largest first). A key captured, skipped by `capture.on_error`,
over the memory budget or too slow to pay is no longer pending; `release()`, `resize_kv()` and
`capture()` make every key pending again.

A call fits an idle gap of milliseconds: its time limit counts from the call's first line, a key is
started only while time is left (so a call ends at most one key's capture past its limit), and GC is
only paused around each key (`gc_paused`): the engine's heap is never collected whole on this path.
A call with nothing pending (and no peers to agree with) returns before any of that.

With data- or tensor-parallel peers a call is a collective: before each key the ranks all-reduce
(MAX) one pair over each group, "this rank stops" (its time is up, or nothing is pending) and its
choice encoded as traffic then capture order; every rank takes the key with the most traffic on
any rank, or every rank stops. So no key is ever captured on one rank only, and dispatch
agreement never meets one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from graphcap.capture.gc_hold import gc_paused
from graphcap.config.byte_counts import format_bytes
from graphcap.errors import DistributedTimeoutError
from graphcap.keys import GraphKey, KeyRegistry, StepStats

if TYPE_CHECKING:  # distributed/ sits beside capture/; only the annotation needs it
    from graphcap.distributed.step import StepAgreement

__all__ = ["LazyCapture", "check_time_limits"]

log = logging.getLogger("graphcap")

_POSITION_BITS = 20  # capture-order positions below 2**20 (keys of 65536 sizes at most, a few per size)
_MAX_TRAFFIC = (1 << 40) - 1  # traffic counts saturate here: the pair stays within int64


class LazyCapture:
    """The pending keys of one manager and the order, agreed with data-parallel peers, they are captured in.

    Does not capture: `run` calls the `capture_key` callable it is given, `capture_key(key) -> ([GraphRecord], bytes)`
    (the key's record, and the device memory its capture added).
    """

    def __init__(
        self,
        registry: KeyRegistry,
        stats: StepStats,
        peers: StepAgreement | None = None,
        *,
        is_lazy: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._registry, self._stats, self._peers = registry, stats, peers
        self.is_lazy = is_lazy
        """`capture.strategy: lazy`: `capture()` leaves every key pending."""
        self.clock = clock
        """Seconds, for `max_seconds` (a test injects a clock that advances only when keys are captured)."""
        self.records: dict[GraphKey, Any] = {}
        """The latest `GraphRecord` of each key `run` took (captured, or skipped and why)."""

    def traffic(self, key: GraphKey) -> int:
        """Steps that wanted `key`: eager steps while it had no graph, plus replays it served."""
        return self._registry.demand[key] + self._stats.graph_hits[key]

    def ordered(self) -> list[GraphKey]:
        """The pending keys, most traffic first; equal traffic in upfront capture order (largest first)."""
        pending = self._registry.pending()  # already in capture order: the stable sort keeps it for ties
        return sorted(pending, key=lambda key: -self.traffic(key))

    def run(
        self,
        capture_key: Callable[[GraphKey], tuple[list, int]],
        max_seconds: float | None = None,
        max_keys: int | None = None,
        start: float | None = None,
    ) -> int:
        """Capture pending keys until none is left, `max_seconds` have passed or `max_keys` were taken.

        `start`: the `clock()` reading the time limit counts from (the caller's first line; None: now).
        A key is started only while time is left (one key may end past `max_seconds`); returns how
        many keys got a graph. GC is paused around each key, never collected whole. Collective with
        a group: every rank takes the same keys in this call.
        """
        clock = self.clock
        start = clock() if start is None else start
        taken, captured, grew = 0, 0, 0
        while True:
            stop = (max_keys is not None and taken >= max_keys) or (
                max_seconds is not None and clock() - start >= max_seconds
            )
            key = self._next(stop)
            if key is None:
                break
            taken += 1
            with gc_paused():  # not collected first: a full collection of an engine's heap outlasts the gap
                records, memory = capture_key(key)
            grew += memory
            for record in records:
                self.records[record.key] = record
                captured += record.status == "captured"
        if taken:
            pending = self._registry.num_pending
            seconds, grown = clock() - start, format_bytes(grew)
            log.info(
                "capture_pending: %d of %d keys in %.2f s (%s); %d pending", captured, taken, seconds, grown, pending
            )
        return captured

    def _next(self, stop: bool) -> GraphKey | None:
        """The key to capture next (None: this call stops), agreed with every peer (`StepAgreement`)."""
        ordered = [] if stop else self.ordered()
        if self._peers is None:
            return ordered[0] if ordered else None
        order = self._registry.capture_order()
        choice = 0
        if ordered:
            position = order.index(ordered[0])
            choice = (min(self.traffic(ordered[0]), _MAX_TRAFFIC) << _POSITION_BITS) | (
                (1 << _POSITION_BITS) - 1 - position
            )
        any_stop, agreed = int(not ordered), choice
        for sync in self._peers.syncs:  # DP then TP: every rank of a grid learns the maxima
            any_stop, agreed = sync.reduce_max([any_stop, agreed], "capture_pending", self._peers.steps)
        if any_stop:
            return None
        key = order[(1 << _POSITION_BITS) - 1 - (agreed & ((1 << _POSITION_BITS) - 1))]
        if key not in self._registry.pending():
            raise DistributedTimeoutError(
                f"capture_pending: the ranks agreed to capture {key}, which this rank (rank "
                f"{self._peers.rank}) already captured or skipped: the ranks are out of step; every rank must call "
                "capture(), capture_pending(), release() and resize_kv() together, in the same order"
            )
        return key


def check_time_limits(max_seconds: Any, max_keys: Any) -> None:
    """`ValueError` naming the argument when `max_seconds` is not None or a number >= 0, or `max_keys`
    not None or an integer >= 0."""
    if max_seconds is not None and (
        isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds >= 0
    ):
        raise ValueError(
            f"capture_pending(max_seconds=...) must be None (no limit) or seconds >= 0; got {max_seconds!r}"
        )
    if max_keys is not None and (isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 0):
        raise ValueError(f"capture_pending(max_keys=...) must be None (no limit) or an integer >= 0; got {max_keys!r}")
