"""Graphs over an engine's life: the mini engine's lifecycle run against a run without it,
release/capture cycles and resize_kv cycles.
"""

from __future__ import annotations

import numpy as np

from graphcap import BatchError, StepBatch
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
    ]
