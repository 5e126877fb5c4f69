"""Crashes for the post-mortem tests: a CUDA-style device-side assert at a chosen step, and the founding bug.

`device_asserts(manager)` makes every captured graph's replay act as a kernel with a device-side
assert: it raises the CUDA error when the staged `query_start_loc` drops (the `repeat >= 0` assert of
`repeat_interleave` the founding bug hit) or when step `at` of the replays comes. `founding_bug(manager)`
makes the model's `prepare` leave the padded tail of `query_start_loc` at 0 after staging filled it
(`[0, 3, 0, 0, 0]` for one 3-token request at 4 request rows), the rows a graph then reads. `manager_for`
builds a captured-ready manager with the recorder on and its post-mortem under a test's directory;
`crash` runs a step that must die of the CUDA error and returns the error.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphcap import StepBatch
from graphcap.testing import make_config, make_manager

CUDA_ASSERT = "CUDA error: device-side assert triggered"


def cuda_error() -> RuntimeError:
    return RuntimeError(f"{CUDA_ASSERT}\nCUDA kernel errors might be asynchronously reported at some other API call")


def device_asserts(manager, at: int | None = None) -> list[int]:
    """Wrap every graph's replay; returns the list of replays counted (the step numbers it ran)."""
    count: list[int] = []
    host = manager.buffers.host["query_start_loc"]
    for key, graph in manager.graphs.items():
        real = graph._replay

        def replay(real=real, rows=key.num_reqs + 1):
            count.append(len(count) + 1)
            if (np.diff(host[:rows].astype(np.int64)) < 0).any() or len(count) == at:
                raise cuda_error()
            return real()

        graph._replay = replay
    return count


def founding_bug(manager) -> None:
    """The model's `prepare` zeroes `query_start_loc` after the real requests' offsets (replays only)."""

    def prepare(inputs, phase):
        if phase == "replay":
            inputs.host.query_start_loc[inputs.num_reqs + 1 :] = 0

    manager._prepare = prepare


def decode(num_reqs: int, seq_len: int = 3) -> StepBatch:
    """`num_reqs` decodes at `seq_len`, request i in blocks 1 + 2i, 2 + 2i (block size 4)."""
    blocks = np.stack([1 + 2 * np.arange(num_reqs), 2 + 2 * np.arange(num_reqs)], axis=1).astype(np.int32)
    return StepBatch(
        np.ones(num_reqs, np.int32), np.full(num_reqs, seq_len, np.int32), np.arange(num_reqs, dtype=np.int32), blocks
    )


def prefill(num_tokens: int = 3) -> StepBatch:
    """One request's first `num_tokens` tokens, in block 1."""
    return StepBatch(
        np.array([num_tokens], np.int32),
        np.array([num_tokens], np.int32),
        np.arange(num_tokens, dtype=np.int32),
        np.array([[1, 2]], np.int32),
    )


FOUNDING_BUG_ASSET = "tests/assets/founding-bug-postmortem.json"
"""The post-mortem of `founding_bug_postmortem`, committed: the README's `graphcap inspect` transcript reads it."""


def founding_bug_postmortem(directory) -> str:
    """Two decodes, then one 3-token prefill whose `query_start_loc` tail `prepare` zeroes: the replay's
    device-side assert leaves `graphcap-postmortem.json` in `directory`; its path."""
    overrides = {"report.postmortem": str(directory), "report.flight_steps": 3, "checks.invariants": "off"}
    manager = make_manager(make_config(overrides))
    manager.capture()
    device_asserts(manager)
    manager.execute(decode(2))
    manager.execute(decode(3))
    founding_bug(manager)
    with pytest.raises(RuntimeError, match=CUDA_ASSERT):
        manager.execute(prefill())
    return f"{directory}/graphcap-postmortem.json"


def manager_for(tmp_path, invariants: str = "off", steps: int = 4, **overrides):
    config = make_config(
        {"report.postmortem": str(tmp_path), "report.flight_steps": steps, "checks.invariants": invariants, **overrides}
    )
    manager = make_manager(config, faulty=True)
    return manager


def crash(manager, batch):
    with pytest.raises(RuntimeError, match=CUDA_ASSERT) as info:
        manager.execute(batch)
    return info.value
