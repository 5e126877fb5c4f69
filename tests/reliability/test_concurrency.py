"""Threads: `execute` from several threads never interleaves staging and replay.

Every step here is self-contained, so its output is checked bit for bit against a
single-threaded run. Threads read the returned view under `manager.lock`, as the manager
documents: the next step overwrites it.
"""

from __future__ import annotations

import pytest

from graphcap.testing import (
    NUM_THREADS,
    STEPS_PER_THREAD,
    EventLog,
    NoLock,
    expected_outputs,
    make_config,
    make_manager,
    run_threads,
)


@pytest.fixture(scope="module")
def manager():
    manager = make_manager(make_config())
    manager.capture()
    return manager


@pytest.fixture(scope="module")
def expected(manager):
    return expected_outputs(manager)


def test_threads_never_interleave_staging_and_replay_and_outputs_are_exact(manager, expected):
    steps_before = manager.stats.as_dict()["steps"]
    with EventLog(manager) as log:
        mismatches, errors = run_threads(manager, expected)
    assert errors == []
    assert log.interleavings() == 0
    assert mismatches == 0
    assert len(log.events) == 2 * NUM_THREADS * STEPS_PER_THREAD
    assert manager.stats.as_dict()["steps"] - steps_before == NUM_THREADS * STEPS_PER_THREAD  # no lost count


def test_the_detector_sees_interleaving_when_the_lock_is_gone(manager, expected, monkeypatch):
    """Proves the test above can fail: without the lock, steps interleave (and go wrong)."""
    monkeypatch.setattr(manager._scope, "lock", NoLock())
    with EventLog(manager) as log:
        mismatches, errors = run_threads(manager, expected, seed=1)
    assert log.interleavings() > 0 or mismatches or errors


def test_capture_in_one_thread_while_others_execute(manager, expected):
    """A recapture holds the lock for the whole pass: steps see the old graphs or the new."""
    mismatches, errors = run_threads(manager, expected, seed=2, extra=manager.capture)
    assert errors == []
    assert mismatches == 0
    assert len(manager.graphs) == len(manager.registry.planned)
