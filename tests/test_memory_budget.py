"""`capture.memory_budget`: the graphs' estimated memory never crosses it, upfront or lazy.

A key whose graph would take the estimate (the `graphs` part of `estimate_memory`) past the
budget is not captured: its record says `over_budget`, its steps run eagerly under that reason.
On CPU the emulated backend accounts the estimate; on CUDA the budget is also reserved in the pool.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from graphcap import ConfigError, StepBatch
from graphcap.config.byte_counts import format_bytes
from graphcap.memory.budget import MemoryBudget
from graphcap.memory.estimate import estimate_memory
from graphcap.testing import make_config, make_manager


def _decode(num_reqs: int) -> StepBatch:
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    return StepBatch(np.ones(num_reqs, np.int32), np.full(num_reqs, 9), np.arange(num_reqs), table)


def _pool_segments(handle) -> dict[str, int]:
    """Bytes of the allocator's segments in graph pool `handle`, by segment type (large, small)."""
    found = {"large": 0, "small": 0}
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == tuple(handle):
            found[segment["segment_type"]] += segment["total_size"]
    return found


def _budget_of(config, keys) -> int:
    return MemoryBudget(config, "emulated").estimate(config, keys)


def test_the_estimate_of_every_key_is_the_graphs_part_of_estimate_memory():
    config = make_config()
    keys = make_manager(config).registry.planned
    assert _budget_of(config, keys) == estimate_memory(config, backend="emulated").parts["graphs"]
    assert (
        MemoryBudget(config, "cuda").estimate(config, keys) == estimate_memory(config, backend="cuda").parts["graphs"]
    )


@pytest.mark.parametrize("strategy", ["upfront", "lazy"])
def test_keys_past_the_budget_are_not_captured_and_run_eagerly_as_over_budget(strategy):
    probe = make_config()
    order = make_manager(probe).registry.capture_order()
    budget = _budget_of(probe, order[:2])  # room for the two largest keys exactly
    manager = make_manager(make_config(capture__memory_budget=budget, capture__strategy=strategy))
    report = manager.capture()
    if strategy == "lazy":
        assert manager.capture_pending() == 2
        records = list(manager._lazy.records.values())
    else:
        records = report.records
        assert report.memory_budget["budget_bytes"] == budget
        assert report.memory_budget["estimate_bytes"] == budget
    assert set(manager.graphs) == set(order[:2])
    over = [r for r in records if r.status == "skipped"]
    assert {r.key for r in over} == set(order[2:])
    assert all(r.reason.startswith("over_budget: the graphs would hold") for r in over)
    assert _budget_of(manager.config, manager.graphs) <= budget
    batch = _decode(3)  # the uniform key of 4 tokens: over the budget
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    assert manager.stats.eager["over_budget"] == 1
    assert manager.capture_pending() == 0  # an over-budget key is not pending


def test_a_budget_below_every_key_captures_nothing_and_says_why():
    manager = make_manager(make_config(capture__memory_budget=1))
    report = manager.capture()
    assert not manager.graphs and len(report.skipped) == len(report.records) == 6
    assert "over capture.memory_budget 1 B" in report.records[0].reason


def test_a_budget_takes_sizes_such_as_gib_and_refuses_nonsense_naming_the_key():
    assert make_config(capture__memory_budget="1.5KiB").capture.memory_budget == 1536
    assert make_config(capture__memory_budget="4GiB").capture.memory_budget == 4 << 30
    for bad in ["lots", "0B", "-1", 0]:
        with pytest.raises(ConfigError, match=r"capture.memory_budget: expected bytes >= 1 or a size such as 4GiB"):
            make_config(capture__memory_budget=bad)


def test_the_emulated_backend_reserves_nothing_and_accounts_the_estimate():
    manager = make_manager(make_config(capture__memory_budget="1MiB"))
    report = manager.capture()
    assert manager.backend.reserved_bytes == 1 << 20  # accounted, not allocated
    assert report.memory_budget["reserved_bytes"] == 1 << 20
    assert report.memory_budget["estimate_bytes"] == _budget_of(manager.config, manager.graphs)
    manager.release()
    assert manager.backend.reserved_bytes is None  # released with the graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_budget_is_reserved_in_the_graph_pool_before_capture():
    budget = 256 << 20
    config = make_config(device="cuda", capture__memory_budget=budget, capture__strategy="lazy")
    manager = make_manager(config)
    before = torch.cuda.memory_reserved()
    manager.capture()  # lazy: reserves, captures nothing
    assert manager.backend.reserved_bytes == budget
    assert torch.cuda.memory_reserved() - before >= budget
    handle = manager.backend.pool.handle
    held = _pool_segments(handle)
    assert manager.capture_pending() == len(manager.registry.planned)
    assert _pool_segments(handle) == held  # the graphs took memory the pool held, small blocks included
    batch = _decode(3)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


@pytest.mark.parametrize("strategy", ["upfront", "lazy"])
def test_a_budget_the_device_cannot_hold_is_refused_at_capture_naming_the_key(strategy, monkeypatch):
    manager = make_manager(make_config(capture__memory_budget="64GiB", capture__strategy=strategy))

    def out_of_memory(num_bytes: int) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(manager.backend, "reserve", out_of_memory)
    with pytest.raises(ConfigError, match=r"capture.memory_budget: 68719476736 bytes could not be reserved on cpu"):
        manager.capture()
    assert not manager.graphs and manager.backend.reserved_bytes is None


@pytest.mark.parametrize("strategy", ["upfront", "lazy"])
def test_a_measured_pool_past_a_budget_the_estimate_meets_is_a_warning_naming_both_figures(strategy, caplog):
    # On the emulated backend a graph's measured memory (its tape's peak and output) is about 10x the
    # estimate's graphs part: a budget of half the measured pool admits every key by the estimate.
    measured = make_manager(make_config()).capture().pool_bytes
    budget = measured // 2
    manager = make_manager(make_config(capture__memory_budget=budget, capture__strategy=strategy))
    with caplog.at_level("WARNING", logger="graphcap"):
        report = manager.capture()
        if strategy == "lazy":
            assert manager.capture_pending() == len(manager.registry.planned)
    assert len(manager.graphs) == len(manager.registry.planned)  # the estimate met the budget for every key
    estimate = _budget_of(manager.config, manager.graphs)
    assert estimate <= budget < measured
    (warning,) = [r.getMessage() for r in caplog.records if "capture.memory_budget" in r.getMessage()]
    words = (
        rf"capture\.memory_budget {re.escape(format_bytes(budget))} holds to graphcap's estimate of the graphs "
        r"\((.+) for the (\d+) live graphs\), not to measured memory: their captures grew the pool by (.+), "
        r"(\d+\.\d)x the budget\. To keep device memory within it, lower capture\.memory_budget by that ratio"
    )
    shown_estimate, live, grown, ratio = re.fullmatch(words + ".*", warning).groups()
    if strategy == "upfront":  # one call: the whole pool
        assert (shown_estimate, live, grown, ratio) == (format_bytes(estimate), "6", format_bytes(measured), "2.0")
        assert report.warnings == [warning] and report.memory_budget["pool_bytes"] == measured
        assert f"warning: {warning}" in report.summary()
    else:  # logged once, by the capture_pending key that crossed it
        assert int(live) < 6 and float(ratio) > 1.0


def test_a_measured_pool_within_the_budget_warns_nothing(caplog):
    measured = make_manager(make_config()).capture().pool_bytes
    with caplog.at_level("WARNING", logger="graphcap"):
        report = make_manager(make_config(capture__memory_budget=measured)).capture()
    assert report.warnings == [] and not [r for r in caplog.records if "memory_budget" in r.getMessage()]
