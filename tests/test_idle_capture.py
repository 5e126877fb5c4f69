"""Idle-time capture between steps (`capture.strategy: lazy`): what `capture_pending()` leaves as it was.

The rules: the last step's outputs read the same after a `capture_pending()` as before it (they
are valid until the next step, and an idle-time capture is no step); `dispatch()` is a query that
counts no traffic; each `capture_pending()` call that captures a key is counted as a capture pass;
after `release()` a lazy manager's `capture()` captures nothing and `capture_pending()` wakes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from graphcap import CaptureManager, GraphKey, StepBatch
from graphcap.testing import make_config, make_manager

LAZY = {"capture.strategy": "lazy"}
DECODE_8 = GraphKey(8, 8, True)


def _decode(num_reqs: int, seed: int = 0) -> StepBatch:
    """`num_reqs` decode requests with distinct blocks (block ids from 1)."""
    rng = np.random.default_rng(seed)
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    return StepBatch(np.ones(num_reqs, np.int32), rng.integers(2, 20, num_reqs), rng.integers(0, 128, num_reqs), table)


def _served_by_the_first_graph():
    """A lazy manager whose one graph (the 8-request decode key) served the last step; the step's output kept."""
    manager = make_manager(make_config(LAZY))
    assert manager.capture_pending(max_keys=1) == 1 and set(manager.graphs) == {DECODE_8}
    batch = _decode(7)
    expected = manager.eager(batch).clone()
    output = manager.execute(batch)  # a view of the graph's static output, not cloned
    assert manager.last_key == DECODE_8
    torch.testing.assert_close(output, expected)
    return manager, output, expected


def test_the_last_steps_output_reads_the_same_after_capture_pending():
    manager, output, expected = _served_by_the_first_graph()
    assert manager.capture_pending(max_keys=3) == 3  # their verification replays run in the same pool
    torch.testing.assert_close(output, expected)
    after = _decode(5, seed=1)  # and the next step replays and overwrites as usual
    torch.testing.assert_close(manager.execute(after).clone(), manager.eager(after))


def test_without_the_protection_capture_pending_overwrites_the_kept_output():
    # The canary: the emulated pool invalidates the kept output (NaN) as a CUDA pool reuses its memory.
    manager, output, _ = _served_by_the_first_graph()
    manager._kept.drop()  # as if nothing kept the last step's outputs
    assert manager.capture_pending(max_keys=3) == 3
    assert torch.isnan(output).all()


def test_after_an_eager_step_capture_pending_copies_nothing():
    manager, _, _ = _served_by_the_first_graph()
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    prefill = StepBatch(np.array([10, 10], np.int32), np.array([12, 12], np.int32), np.arange(20) % 128, table)
    eager = manager.execute(prefill)  # above the largest size: eager
    assert manager.stats.eager["above_max_size"] == 1
    assert manager._kept._output is None
    assert manager.capture_pending(max_keys=1) == 1
    assert not torch.isnan(eager).any()


def test_dispatch_is_a_query_that_counts_no_traffic_for_lazy_capture():
    manager = make_manager(make_config(LAZY))
    for seed in range(2):
        manager.execute(_decode(3, seed))  # twice: the uniform key of 4 tokens
    asked = _decode(7)
    for _ in range(5):  # asked about often, executed once: one step of traffic for the key of 8
        assert manager.dispatch(asked) is None
    manager.execute(asked)
    assert manager.registry.demand[GraphKey(8, 8, True)] == 1
    assert manager.registry.demand[GraphKey(4, 4, True)] == 2
    assert sum(manager.stats.eager.values()) == 3
    assert manager.capture_pending(max_keys=1) == 1
    assert set(manager.graphs) == {GraphKey(4, 4, True)}  # the key steps used most, not the one asked about most


def test_every_capture_pending_call_that_captures_is_counted_as_a_capture_pass():
    manager = make_manager(make_config(LAZY))
    assert manager.capture_pending(max_keys=2) == 2
    assert (manager.stats.captures, manager.stats.graphs_captured) == (1, 2)
    assert manager.capture_pending() == len(manager.registry.planned) - 2
    assert manager.capture_pending() == 0  # nothing pending: no pass
    stats = manager.stats.as_dict()
    assert (stats["captures"], stats["graphs_captured"]) == (2, len(manager.registry.planned))
    manager.capture()  # lazy: a pass that captures nothing, every key pending again
    assert (manager.stats.captures, manager.stats.graphs_captured) == (3, len(manager.registry.planned))


def test_a_lazy_manager_wakes_with_capture_pending_as_the_lifecycle_guide_says():
    manager = make_manager(make_config(LAZY))
    assert manager.capture_pending() == len(manager.registry.planned)
    manager.release()
    report = manager.capture()  # the upfront wake-up: under lazy it captures nothing
    assert report.records == [] and not manager.graphs
    assert len(report.pending) == len(manager.registry.planned)
    batch = _decode(7)
    expected = manager.execute(batch).clone()
    assert manager.stats.eager["pending"] == 1
    assert manager.capture_pending() == len(manager.registry.planned)
    torch.testing.assert_close(manager.execute(batch), expected)
    assert manager.last_key == DECODE_8
    doc = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "lifecycle.md").read_text()
    wake = doc.split("## Release and wake", 1)[1].split("\n## ", 1)[0]
    assert "Under `capture.strategy: lazy`, `capture()` on wake captures nothing" in wake


class _ViewOfItsHead(torch.nn.Module):
    """Returns its logits and a view of its own head: an output outside the pool, which no capture writes."""

    output_rows: ClassVar[dict[str, str]] = {"logits": "tokens", "head": "none"}

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(128, 16, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(16, 128, generator=g), requires_grad=False)

    def forward(self, inputs) -> dict[str, torch.Tensor]:
        return {"logits": self.emb[inputs.input_ids.long()] @ self.head, "head": self.head[:4]}


def test_capture_pending_writes_back_only_outputs_whose_bytes_changed():
    model = _ViewOfItsHead()
    manager = CaptureManager(model, make_config(LAZY), backend="emulated", progress=False)
    assert manager.capture_pending(max_keys=1) == 1
    batch = StepBatch(np.ones(7, np.int32), np.full(7, 5), np.arange(7))
    expected = {name: t.clone() for name, t in manager.eager(batch).items()}
    output = manager.execute(batch)
    assert manager.last_key == DECODE_8 and output["head"].data_ptr() == model.head.data_ptr()
    version = model.head._version
    assert manager.capture_pending(max_keys=3) == 3
    assert model.head._version == version  # the weight the output views was never written
    torch.testing.assert_close(output, expected)
