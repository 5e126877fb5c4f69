"""`capture_pending(max_seconds)` fits an engine's idle gap.

The rules: the time limit counts from the call's first line; a key starts only while time is left, so a
call ends at most one key's capture past its limit and captures at least one key when time is left at its
start; a call with nothing pending returns before any GC work; a call with keys pending collects the
youngest generation only, never the engine's whole heap; `manager.pending()` names the keys it would take.
Time is an injected clock that advances only when the code under test does something: no wall time.
"""

from __future__ import annotations

import gc
import math

import pytest

from graphcap.capture import gc_hold
from graphcap.testing import make_config, make_manager

LAZY = {"capture.strategy": "lazy"}


class _Clock:
    """Seconds that pass only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed_manager(seconds_per_key: float, **overrides):
    """A lazy manager whose clock advances `seconds_per_key` whenever a key is captured."""
    manager = make_manager(make_config({**LAZY, **overrides}))
    clock = manager._lazy.clock = _Clock()
    capture_keys = manager.capturer.capture_keys

    def timed(job, keys, progress):
        clock.now += seconds_per_key * len(keys)
        return capture_keys(job, keys, progress)

    manager.capturer.capture_keys = timed
    return manager, clock


def test_a_limit_shorter_than_one_key_captures_one_key_per_call_and_every_key_in_as_many_calls():
    manager, _ = _timed_manager(seconds_per_key=0.5)
    num_keys = len(manager.registry.planned)
    captured = [manager.capture_pending(max_seconds=0.1) for _ in range(num_keys + 2)]
    assert captured == [1] * num_keys + [0, 0]
    assert set(manager.graphs) == set(manager.registry.planned)


@pytest.mark.parametrize("max_seconds", [0.5, 1.0, 2.5])
def test_a_call_ends_at_most_one_key_past_its_limit(max_seconds):
    manager, clock = _timed_manager(seconds_per_key=1.0)
    assert manager.capture_pending(max_seconds=max_seconds) == math.ceil(max_seconds)
    assert max_seconds <= clock.now < max_seconds + 1.0


def test_the_limit_counts_from_the_first_line_of_the_call():
    manager, clock = _timed_manager(seconds_per_key=1.0)
    check_ready = manager.capturer.check_ready

    def slow_check_ready(*args):  # the work before the first key takes a whole second
        clock.now += 1.0
        return check_ready(*args)

    manager.capturer.check_ready = slow_check_ready
    assert manager.capture_pending(max_seconds=0.5) == 0
    assert manager.capture_pending(max_seconds=1.5) == 1  # the canary: time left after the same work


def test_a_call_with_nothing_pending_does_no_gc_work(monkeypatch):
    manager = make_manager(make_config(LAZY))
    manager.capture_pending()
    assert manager.pending() == []
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append(("collect", *args)) or 0)
    monkeypatch.setattr(gc, "disable", lambda: calls.append(("disable",)))
    assert manager.capture_pending(max_seconds=0.05) == 0
    assert manager.capture_pending() == 0
    assert calls == []


def test_a_call_with_keys_pending_collects_only_the_youngest_generation(monkeypatch):
    manager = make_manager(make_config(LAZY))
    collect, generations = gc.collect, []
    monkeypatch.setattr(gc, "collect", lambda generation=2: generations.append(generation) or collect(generation))
    assert manager.capture_pending(max_keys=2) == 2
    assert generations and set(generations) == {0}
    generations.clear()
    with gc_hold.gc_frozen():  # the canary: the hold of an upfront CUDA pass starts with one full collection
        pass
    assert 2 in generations


def test_gc_is_off_while_a_lazy_key_captures_and_restored_after():
    manager = make_manager(make_config(LAZY))
    frozen = gc.get_freeze_count()  # not 0 on Python 3.12
    seen = []
    forward = manager._forward
    manager._forward = lambda inputs: seen.append((gc.isenabled(), gc_hold.depth())) or forward(inputs)
    manager.capture_pending(max_keys=1)
    # The key's `gc_paused` holds the pass's `gc_frozen` inside it: two holds, GC set up once.
    assert seen and set(seen) == {(False, 2)}
    assert gc.isenabled() and gc_hold.depth() == 0 and gc.get_freeze_count() <= frozen


def test_pending_names_the_keys_capture_pending_takes_in_its_order():
    manager = make_manager(make_config(LAZY))
    pending = manager.pending()
    assert pending == manager.registry.capture_order()
    manager.capture_pending(max_keys=1)
    assert set(manager.graphs) == {pending[0]}
    assert manager.pending() == pending[1:]
    manager.capture_pending()
    assert manager.pending() == []
    manager.release()
    assert manager.pending() == pending


def test_an_upfront_manager_has_nothing_pending_after_capture():
    manager = make_manager(make_config())
    assert len(manager.pending()) == len(manager.registry.planned)
    manager.capture()
    assert manager.pending() == []
