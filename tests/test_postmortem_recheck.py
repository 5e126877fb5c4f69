"""The post-mortem's re-check: the founding bug and a KV write named from the file, engine buffers and KV groups
recorded, the committed founding-bug file held to the real crash, and the file's verdict held to the live check's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap import InvariantViolation, StepBatch, check_invariants
from graphcap.fields import FIELDS
from graphcap.postmortem.file import write_postmortem
from graphcap.postmortem.recheck import load_postmortem, recheck
from tests.postmortem_cases import (
    CUDA_ASSERT,
    FOUNDING_BUG_ASSET,
    crash,
    decode,
    device_asserts,
    founding_bug,
    founding_bug_postmortem,
    manager_for,
    prefill,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_founding_bug_replayed_raw_is_named_by_the_recheck(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager)
    manager.execute(decode(2))
    founding_bug(manager)
    assert manager.dispatch(prefill()) is not None
    crash(manager, prefill())
    checks = recheck(load_postmortem(tmp_path / "graphcap-postmortem.json"))
    broken = [c for c in checks if c.violation is not None]
    assert [c.step["step"] for c in broken] == [2]
    assert broken[0].violation.field == "query_start_loc" and broken[0].violation.index == 2
    assert "offsets must never decrease" in str(broken[0].violation)


def test_a_slot_written_outside_its_block_is_named_by_the_kv_write_rules(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=1)

    def prepare(inputs, phase):
        inputs.host.slot_mapping[1] = inputs.host.slot_mapping[0]  # request 1 writes request 0's slot

    manager._prepare = prepare
    crash(manager, decode(2))
    violation = recheck(load_postmortem(tmp_path / "graphcap-postmortem.json"))[-1].violation
    assert violation is not None and violation.field == "slot_mapping"


def test_the_committed_founding_bug_postmortem_is_what_the_crash_writes(tmp_path):
    # The README's `graphcap inspect` transcript reads the committed file: it must be the real one.
    written = json.loads(Path(founding_bug_postmortem(tmp_path)).read_text())
    committed = json.loads((ROOT / FOUNDING_BUG_ASSET).read_text())
    assert written == committed


def test_engine_buffers_and_kv_groups_are_recorded_and_their_rules_rechecked(tmp_path):
    window = {"name": "window", "block_size": 2, "num_blocks": 90, "sliding_window": 5}
    temperature = {"name": "temperature", "rows": "reqs", "dtype": "float32", "pad": 1.0}
    manager = manager_for(tmp_path, **{"kv_cache.groups": [window], "buffers": [temperature]})
    manager.capture()
    device_asserts(manager, at=3)
    step = decode(3)
    window_table = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)  # 3 blocks of 2 slots per request
    batch = type(step)(step.query_lens, step.seq_lens, step.input_ids, step.block_table,
                       extras={"temperature": [0.7, 1.3, 1.0]}, kv_groups={"window": window_table})  # fmt: skip
    manager.execute(batch)
    corrupt = iter([
        lambda host, r: host.extras["temperature"].__setitem__(slice(r, None), 5.0),  # a stale engine tail
        lambda host, r: host.kv_groups["window"].slot_mapping.__setitem__(1, host.kv_groups["window"].slot_mapping[0]),
    ])  # fmt: skip
    manager._prepare = lambda inputs, phase: next(corrupt)(inputs.host, inputs.num_reqs)
    manager.execute(batch)
    with pytest.raises(RuntimeError, match=CUDA_ASSERT):
        manager.execute(batch)
    document = load_postmortem(tmp_path / "graphcap-postmortem.json")
    names = {name for name, _, _ in document["steps"][-1]["spans"]}
    assert {"temperature", "kv_groups.window.slot_mapping", "kv_groups.window.block_table"} <= names
    found = [c.violation.field if c.violation else None for c in recheck(document)][-3:]
    assert found == [None, "temperature", "kv_groups['window'].slot_mapping"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A captured manager whose recorder keeps 1 step, invariants off (the rows reach the replay as staged)."""
    manager = manager_for(tmp_path_factory.mktemp("recorded"), steps=1)
    manager.capture()
    for graph in manager.graphs.values():  # rows the checks would refuse never reach a kernel, not even on the CPU
        graph._replay = lambda: None
    return manager


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.tuples(st.integers(1, 2), st.integers(0, 4)), min_size=1, max_size=4),
    field=st.sampled_from(["none", *FIELDS]),
    where=st.integers(0, 10**6),
    value=st.integers(-3, 80),
)
def test_the_recheck_of_a_recorded_step_finds_what_the_live_check_finds(recorded, tmp_path, lens, field, where, value):
    """Any step, any one entry of any field overwritten after staging: the file's re-check names the same
    field and index as `check_invariants` at `full` on the live rows (or passes where it passes)."""
    q = np.array([n for n, _ in lens], np.int32)
    s = q + np.array([c for _, c in lens], np.int32)
    tables = np.array([[1 + 2 * i, 2 + 2 * i] for i in range(len(lens))], np.int32)
    batch = StepBatch(q, s, np.arange(int(q.sum()), dtype=np.int32) % 128, tables)
    assert recorded.dispatch(batch) is not None  # a replay (hollow): no forward reads the corrupted rows
    live = []

    def prepare(inputs, phase):
        if field != "none":
            rows = getattr(inputs.host, field).reshape(-1)
            rows[where % rows.size] = value
        try:
            check_invariants(inputs, "full")
            live.append(None)
        except InvariantViolation as exc:
            live.append((exc.field, str(exc.index)))

    recorded._prepare = prepare
    try:
        recorded.execute(batch)
    finally:
        recorded._prepare = None
    path = write_postmortem(
        RuntimeError(CUDA_ASSERT), "execute", "replay", recorded._flight.steps(), setting=str(tmp_path),
        fields=recorded.buffers.layout.entries, limits=recorded.buffers.limits, invariants="off",
    )  # fmt: skip
    (check,) = recheck(load_postmortem(path))
    found = None if check.violation is None else (check.violation.field, str(check.violation.index))
    assert found == live[-1]
