"""What each graph buys: capture times a key's replay against an eager run of the same batch.

Tests never assert timings: the mechanism is tested with an injected timer, and `capture.min_speedup`
set so high that every key is dropped or so low that none is.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from graphcap import CaptureManager, StepBatch
from graphcap.capture.timing import SPEEDUP_REPS, replay_speedup
from graphcap.models import build_model
from graphcap.probe import probe_batches_run
from graphcap.testing import FaultyModel, make_config, make_manager


class _Clock:
    """A timer that advances only when a side runs: replay 1 s, eager 3 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Backend:
    name = "emulated"

    def synchronize(self) -> None:
        pass


def test_replay_speedup_is_the_median_eager_time_over_the_median_replay_time():
    clock, runs = _Clock(), []
    replay = lambda: (runs.append("replay"), clock.advance(1.0))  # noqa: E731
    eager_times = iter([3.0, 100.0, 2.0])  # one outlier: the median ignores it
    eager = lambda: (runs.append("eager"), clock.advance(next(eager_times)))  # noqa: E731
    assert replay_speedup(replay, eager, _Backend(), reps=3, timer=clock) == 3.0
    assert runs == ["replay", "eager"] * 3  # interleaved: both sides see the same load


def test_a_replay_that_takes_no_measurable_time_is_infinitely_faster():
    clock = _Clock()
    assert replay_speedup(lambda: None, lambda: clock.advance(1.0), _Backend(), timer=clock) == math.inf


def test_every_captured_key_records_its_speedup():
    manager = make_manager(make_config())
    report = manager.capture()
    assert all(r.speedup is not None and r.speedup > 0 for r in report.records)
    assert all(graph["speedup"] > 0 for graph in report.to_dict()["graphs"])


def _decode(num_reqs: int) -> StepBatch:
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    return StepBatch(np.ones(num_reqs, np.int32), np.full(num_reqs, 9), np.arange(num_reqs), table)


@pytest.mark.parametrize("strategy", ["upfront", "lazy"])
def test_keys_below_min_speedup_are_released_and_run_eagerly_as_no_speedup(strategy):
    manager = make_manager(make_config(capture__min_speedup=1e9, capture__strategy=strategy))
    report = manager.capture()
    if strategy == "lazy":
        assert manager.capture_pending() == 0
        records = list(manager._lazy.records.values())
    else:
        records = report.records
    assert len(records) == len(manager.registry.planned)
    assert all(r.status == "skipped" and r.reason.startswith("no_speedup: replay ") for r in records)
    assert all("below capture.min_speedup 1e+09" in r.reason and r.speedup > 0 for r in records)
    assert not manager.graphs and manager.backend.graphs == ()  # released, not just unused
    batch = _decode(3)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    assert manager.stats.eager["no_speedup"] == 1
    assert manager.capture_pending() == 0  # a key that did not pay is not pending


def test_a_min_speedup_every_key_beats_keeps_every_graph():
    manager = make_manager(make_config(capture__min_speedup=1e-9))
    report = manager.capture()
    assert len(report.captured) == len(manager.registry.planned) == len(manager.graphs)


@pytest.mark.parametrize("min_speedup", [None, 1e-9])
def test_keys_are_timed_again_only_when_a_minimum_decides(min_speedup):
    config = make_config(capture__min_speedup=min_speedup)
    model = FaultyModel(build_model(config))  # counts forward calls per key
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    extra = 0 if min_speedup is None else SPEEDUP_REPS  # eager runs of the key's own dummy batch
    # one warmup, the capture (which runs the preflight's checks) and the eager run of each probe batch no earlier
    # key probed (verification compares the dummy batch's replay with the warmup's output: no engine context, no
    # peers)
    registry = manager.registry
    shapes = {registry.capture_shape(key): key for key in registry.capture_order()}
    runs = probe_batches_run(shapes, max_model_len=config.kv_cache.max_model_len)
    for shape, key in shapes.items():
        assert model.calls[key] == 2 + runs[shape] + extra, key


def test_without_verification_or_a_minimum_no_speedup_is_recorded():
    manager = make_manager(make_config(checks__verify_replay=False))
    report = manager.capture()
    assert report.captured and all(r.speedup is None for r in report.records)
