"""GC holds: only the outermost hold sets GC up and restores it, counted by graphcap, on every exit path.

The rules: `gc_frozen` collects the whole heap once before and the young generations after; `gc_paused`
collects nothing before and the youngest generation after; a hold inside another does nothing; GC's
state is restored (enabled or not) when the outermost hold ends, by an exception too; nothing is frozen.
"""

from __future__ import annotations

import gc

import pytest

from graphcap.capture.gc_hold import depth, gc_frozen, gc_paused


@pytest.fixture
def collections(monkeypatch):
    """The generations collected, in order (each collection still runs)."""
    collect, seen = gc.collect, []
    monkeypatch.setattr(gc, "collect", lambda generation=2: seen.append(generation) or collect(generation))
    return seen


def test_frozen_collects_the_heap_before_and_the_young_generations_after(collections):
    with gc_frozen():
        assert collections == [2] and not gc.isenabled() and depth() == 1
    assert collections == [2, 1] and gc.isenabled() and depth() == 0


def test_paused_collects_nothing_before_and_the_youngest_generation_after(collections):
    with gc_paused():
        assert collections == [] and not gc.isenabled() and depth() == 1
    assert collections == [0] and gc.isenabled() and depth() == 0


def test_a_hold_inside_another_does_nothing(collections):
    with gc_paused():
        with gc_frozen():
            assert collections == [] and depth() == 2
        assert not gc.isenabled() and collections == []  # the outer hold still holds
    assert collections == [0] and gc.isenabled() and depth() == 0


def test_the_outermost_hold_restores_gc_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"), gc_paused(), gc_frozen():
        raise RuntimeError("inside")
    assert gc.isenabled() and depth() == 0


def test_gc_that_was_off_stays_off():
    gc.disable()
    try:
        with gc_frozen():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_no_hold_freezes_the_heap_or_thaws_the_engines():
    before = gc.get_freeze_count()  # not 0 on Python 3.12 (objects frozen at start-up)
    with gc_frozen(), gc_paused():
        assert gc.get_freeze_count() <= before
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert 0 < gc.get_freeze_count() <= frozen  # refcounts may free some; nothing thawed, nothing added
    finally:
        gc.unfreeze()


def test_frozen_without_the_first_collection_collects_only_the_young_generations_after(collections):
    with gc_frozen(collect_first=False):
        assert collections == [] and not gc.isenabled() and depth() == 1
    assert collections == [1] and gc.isenabled() and depth() == 0


def test_an_emulated_capture_pass_collects_no_old_generation(collections):
    # the emulated backend has no device memory for a full collection to free first
    from graphcap.testing import make_config, make_manager

    manager = make_manager(make_config())
    collections.clear()
    manager.capture()
    assert 2 not in collections and manager.graphs
