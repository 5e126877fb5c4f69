"""Graphs over an engine's life: the mini engine's lifecycle run against a run without it,
release/capture cycles and resize_kv cycles.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcap import BatchError, CaptureError, ConfigError, StepBatch
from graphcap.capture.verification import assert_close
from graphcap.testing import make_config, make_manager

from .moved_inputs import PROBE_STEP
from .trials import Row, Scale, Tally


def lifecycle_rows(scale: Scale) -> list[Row]:
    """The mini engine's whole life against a run without it; release/capture and resize_kv cycles."""
    import mini_engine  # tools/: the engine the README describes

    engine = Tally()
    for seed in range(scale.lifecycle_seeds):
        with engine.trial(f"seed {seed}"):
            plain = mini_engine.run(scale.lifecycle_steps, seed)
            lived = mini_engine.run(scale.lifecycle_steps, seed, lifecycle=True)
            if lived.digest != plain.digest:
                raise AssertionError(f"token streams differ: {lived.digest} != {plain.digest}")
            stats = lived.manager.stats
            if (len(lived.engine.refused), stats.captures, stats.eager["released"]) != (1, 5, 3):
                raise AssertionError(f"lifecycle not run as planned: {lived.events}")
    cycles, resized = Tally(), Tally()
    manager = make_manager(make_config())
    packed = manager.buffers.storage()["packed"].data_ptr()
    for cycle in range(scale.lifecycle_cycles):
        with cycles.trial(f"release cycle {cycle}"):
            manager.capture()
            released = manager.release()
            if released != len(manager.registry.planned) or manager.backend.memory_in_use() or manager.graphs:
                raise AssertionError(f"released {released}; {manager.backend.memory_in_use()} bytes left")
            asleep = manager.execute(PROBE_STEP).clone()
            report = manager.capture()
            if report.recapture["after"] != "release()" or manager.buffers.storage()["packed"].data_ptr() != packed:
                raise AssertionError(f"not a re-capture on the same buffers: {report.recapture}")
            assert_close(manager.execute(PROBE_STEP).clone(), asleep)
    manager = make_manager(make_config())
    manager.capture()
    grown = 72 + 24 * (1 + np.arange(scale.lifecycle_cycles))
    for cycle, num_blocks in enumerate(grown.tolist()):
        with resized.trial(f"resize cycle {cycle}"):
            manager.model.resize_kv_cache(num_blocks)
            manager.resize_kv(num_blocks)
            manager.block_table.set_row(0, [num_blocks - 1, num_blocks - 2])
            step = StepBatch([2], [6], [3, 4], manager.block_table)
            eager = manager.execute(step).clone()
            manager.capture(scratch_blocks=range(1, 40))
            assert_close(manager.execute(step).clone(), eager)
            try:
                manager.resize_kv(num_blocks - 1)
            except BatchError as exc:
                if f"holds block {num_blocks - 1}" not in str(exc) or not manager.graphs:
                    raise AssertionError(f"refused without naming the block, or changed: {exc}") from None
            else:
                raise AssertionError("shrank past a live block")
            manager.block_table.clear(0)
    refused, kept = _refused_resize_trials(), _kept_output_trials(scale.lifecycle_cycles)
    return [
        engine.row(
            "lifecycle",
            f"mini engine (hybrid: 2 KV groups) with a weight swap, a re-capture, release and wake, the KV cache "
            f"grown with resize_kv: {scale.lifecycle_seeds} seeds x {scale.lifecycle_steps} steps",
            "every step graph == eager == dense, token streams identical to a run without any of it",
        ),
        cycles.row(
            "lifecycle",
            "release() then capture() cycles on one manager, a step between",
            "every graph and its memory freed, the step eager and equal, capture serves again on the same buffers",
        ),
        resized.row(
            "lifecycle",
            "resize_kv cycles: the cache grown, steps on the new blocks, captured again, a shrink past a live block",
            "graph == eager on the new blocks; the shrink refused naming the block, nothing changed",
        ),
        refused.row(
            "lifecycle",
            "refused resize_kv: an unnamed or sparse tensor, a block_dim it lacks, a count the config refuses, "
            "a cache smaller than the count, an unknown group",
            "refused naming what is wrong; config, bound and graphs unchanged, a step on a block past the refused "
            "bound replays == eager",
        ),
        kept.row(
            "lifecycle",
            "lazy capture_pending() between two steps, the last step's replayed output kept (not cloned)",
            "the kept output == eager after the capture, and the next step replays == eager",
        ),
    ]


_REFUSED_RESIZES = [  # (num_blocks, tensors, keyword arguments, error, words of its message)
    (60, {"": torch.zeros(60, 4)}, {}, TypeError, "non-empty strings"),
    (60, {"cache": torch.zeros(60, 4).to_sparse()}, {}, CaptureError, "without storage of its own"),
    (60, {"cache": torch.zeros(60, 4)}, {"block_dim": 2}, ValueError, "block_dim 2 is not a dim"),
    (1, None, {}, ConfigError, "kv_cache.num_blocks: must be >= 2"),
    (True, None, {}, ConfigError, "must be an integer"),
    (60, {"cache": torch.zeros(50, 4)}, {}, ConfigError, "cache holds 50"),
    (80, None, {"group": "window"}, ConfigError, "no group named 'window'"),
]


def _refused_resize_trials() -> Tally:
    """Each refused `resize_kv` leaves the config, the bound and the graphs as they were."""
    tally = Tally()
    manager = make_manager(make_config())
    manager.capture()
    manager.block_table.set_row(0, [1, 65, 2])  # block 65: past the bound of 60 the refusals would set
    step = StepBatch([1], [9], [3], manager.block_table)
    expected = manager.eager(step).clone()
    for num_blocks, tensors, kwargs, error, words in _REFUSED_RESIZES:
        with tally.trial(f"resize_kv({num_blocks!r}, {tensors and list(tensors)}, {kwargs})"):
            graphs = dict(manager.graphs)
            try:
                manager.resize_kv(num_blocks, tensors, **kwargs)
            except error as exc:
                if words not in str(exc):
                    raise AssertionError(f"refused without naming it: {exc}") from None
            else:
                raise AssertionError("accepted")
            if (manager.config.kv_cache.num_blocks, manager.buffers.limits.num_blocks) != (72, 72):
                raise AssertionError("the bound changed")
            if manager.graphs != graphs:
                raise AssertionError("the graphs changed")
            assert_close(manager.execute(step).clone(), expected)
            if manager.last_key not in graphs:
                raise AssertionError(f"ran eagerly as {manager.last_key}")
    return tally


def _kept_output_trials(cycles: int) -> Tally:
    """A lazy manager's last replayed output, kept across `capture_pending()`, still reads eager's values."""
    tally = Tally()
    rng = np.random.default_rng(0)
    manager = make_manager(make_config(capture__strategy="lazy"))
    for cycle in range(cycles):
        with tally.trial(f"cycle {cycle}"):
            manager.release()
            manager.capture_pending(max_keys=1)  # the busiest key: the 8-token decode of the steps below
            num_reqs = int(rng.integers(5, 9))
            table = np.arange(1, 1 + num_reqs * 4, dtype=np.int32).reshape(num_reqs, 4)
            step = StepBatch(np.ones(num_reqs, np.int32), rng.integers(2, 16, num_reqs), np.arange(num_reqs), table)
            expected = manager.eager(step).clone()
            output = manager.execute(step)
            if manager.last_key not in manager.graphs:
                raise AssertionError(f"the step ran eagerly as {manager.last_key}")
            manager.capture_pending(max_keys=2)
            assert_close(output, expected)
            assert_close(manager.execute(step).clone(), expected)
    return tally
