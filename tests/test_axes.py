"""Key axes on real tensors: capture walks every combination, replays equal eager at every axis value,
padded axis slots are verified neutral, and the estimate, budget, lazy capture, `min_speedup` and the
report all see the axis keys (`tests/axes_models.py`: the reference decoder plus LoRA-style slots)."""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureError, CaptureManager, GraphKey
from graphcap.capture.verifier import Verifier
from graphcap.memory.estimate import estimate_memory
from graphcap.testing import make_config
from tests.axes_models import AXES, SlotLlama, buffers, lora_step

STEPS = [  # (query lens, each request's adapter (-1: none)): 0 to 5 adapters, decode and mixed
    ([1, 1, 1], [0, 1, 2]),
    ([2, 1], [5, -1]),
    ([1, 1], [-1, -1]),
    ([3, 2, 1], [4, 4, 3]),
    ([1] * 5, [0, 1, 2, 3, 4]),
]


def manager(*, neutral: bool = True, **overrides) -> CaptureManager:
    torch.set_num_threads(1)
    config = make_config({"capture.axes": AXES, "capture.sizes": [2, 4, 8], **overrides})
    return CaptureManager(SlotLlama(config, neutral=neutral), config, progress=False, buffers=buffers())


@pytest.fixture(scope="module")
def captured():
    m = manager()
    return m, m.capture()


def lora_of(key: GraphKey) -> int:
    return dict(key.axes)["lora"]


def test_capture_walks_every_combination_largest_first_and_verifies_each(captured):
    m, report = captured
    assert len(report.records) == 4 * 6 and all(r.verified for r in report.records)  # 6 token keys x 4 slot counts
    keys = [r.key for r in report.records]
    assert keys == m.registry.capture_order() and [lora_of(k) for k in keys[:2]] == [4, 4]
    assert {lora_of(k) for k in m.graphs} == {0, 1, 2, 4}


@pytest.mark.parametrize(("query_lens", "adapters"), STEPS)
def test_every_step_replays_the_padded_slot_count_and_equals_eager(captured, query_lens, adapters):
    m, _ = captured
    batch = lora_step(query_lens, adapters, seed=len(query_lens))
    used = batch.axes["lora"]
    output = m.execute(batch).clone()
    torch.testing.assert_close(output, m.eager(batch))
    if used > 4:  # above capture.axes.lora's largest: eager, under the reason naming the axis
        assert m.last_key == GraphKey(batch.num_tokens, batch.num_reqs, False, (("lora", used),))
        assert m.stats.eager["above_max_axis.lora"] >= 1
        return
    key = m.dispatch(batch)
    assert lora_of(key) == min(v for v in AXES["lora"] if v >= used)
    assert m.stats.graph_hits[key] >= 1


def test_the_adapters_change_the_logits_so_the_comparison_can_fail(captured):
    """Control: the slot loop is not a no-op, so equal outputs above mean the right adapters ran."""
    m, _ = captured
    with_adapters, without = lora_step([1, 1, 1], [0, 1, 2], seed=3), lora_step([1, 1, 1], [-1, -1, -1], seed=3)
    assert not torch.allclose(m.eager(with_adapters), m.eager(without))


def test_the_model_reads_the_key_values_as_inputs_axes():
    seen = []
    m = manager(**{"capture.sizes": [4]})
    forward = m._forward
    m._forward = lambda inputs: seen.append(inputs.axes) or forward(inputs)
    m.capture()
    assert {tuple(sorted(axes.items())) for axes in seen} >= {(("lora", v),) for v in AXES["lora"]}
    seen.clear()
    m.execute(lora_step([1, 1, 1], [0, 1, 2]))  # a full graph: no Python runs at replay
    m.eager(lora_step([1, 1, 1], [0, 1, 2]))
    assert seen == [{"lora": 3}]  # the eager run sees the step's own value, unpadded


def test_a_model_not_neutral_to_padded_slots_is_refused_at_capture_naming_the_axis():
    message = (
        r"uniform\(tokens=8, reqs=8, lora=4\).*capture\.axes lora 0 \(the graph holds 4\).*not neutral to padded lora"
    )
    with pytest.raises(CaptureError, match=message):
        manager(neutral=False).capture()


def test_without_the_axis_check_the_leak_reaches_real_steps(monkeypatch):
    """Canary: the non-neutral model passes every other verification and gives wrong logits on a padded step."""
    monkeypatch.setattr(Verifier, "axes", lambda self, key, graph: 0.0)
    m = manager(neutral=False, **{"capture.sizes": [4]})
    m.capture()
    batch = lora_step([1, 1, 1], [0, 1, 2])  # 3 adapters: the graph of 4 slots runs one empty slot
    with pytest.raises(AssertionError):
        torch.testing.assert_close(m.execute(batch).clone(), m.eager(batch))


def test_the_estimate_counts_a_graph_per_combination():
    config = make_config({"capture.axes": AXES})
    plain = estimate_memory(make_config())
    with_axes = estimate_memory(config)
    assert len(with_axes.graphs) == 4 * len(plain.graphs)
    assert with_axes.parts["graphs"] == 4 * plain.parts["graphs"]  # emulated: every graph's output stays


def test_the_report_shows_each_key_s_axis_values(captured):
    _, report = captured
    table = report.table().splitlines()
    assert table[0].split()[:4] == ["key", "tokens", "reqs", "lora"]
    assert table[1].split()[:4] == ["uniform", "8", "8", "4"]
    assert report.to_dict()["graphs"][0]["key"]["axes"] == {"lora": 4}


def test_a_budget_keeps_the_largest_combinations_first_and_names_the_others():
    m = manager(**{"capture.sizes": [4]})
    graphs = estimate_memory(m.config).graphs  # one per key, all the same size here
    m2 = manager(**{"capture.sizes": [4], "capture.memory_budget": 3 * graphs[0].output})
    report = m2.capture()
    kept = [r.key for r in report.captured]
    assert [lora_of(k) for k in kept] == [4, 4, 2] and len(report.skipped) == 5
    assert "over_budget" in report.skipped[0].reason and "lora=" in report.summary()
    batch = lora_step([1, 1, 1], [-1, -1, -1])
    torch.testing.assert_close(m2.execute(batch).clone(), m2.eager(batch))
    assert m2.stats.eager["over_budget"] == 1  # lora 0's graph was left out


def test_min_speedup_judges_every_combination():
    m = manager(**{"capture.sizes": [4], "capture.min_speedup": 1e9})  # no graph is that fast
    report = m.capture()
    assert len(report.skipped) == 8 and {lora_of(r.key) for r in report.skipped} == {0, 1, 2, 4}
    assert all(r.reason.startswith("no_speedup") for r in report.skipped)
    m.execute(lora_step([1, 1], [3, -1]))
    assert m.stats.eager["no_speedup"] == 1


def test_lazy_capture_takes_the_most_used_combination_first():
    m = manager(**{"capture.sizes": [4], "capture.strategy": "lazy"})
    m.capture()
    for _ in range(3):
        m.execute(lora_step([1, 1, 1], [0, 1, -1]))  # lora 2: pending, eager
    m.execute(lora_step([1, 1, 1], [0, -1, -1]))  # lora 1 once
    assert m.stats.eager["pending"] == 4
    assert m.capture_pending(max_keys=2) == 2  # the step's uniform key and the mixed key it falls back to
    assert {(k.uniform, lora_of(k)) for k in m.graphs} == {(True, 2), (False, 2)}
    m.capture_pending(max_keys=1)
    assert GraphKey(4, 4, True, (("lora", 1),)) in m.graphs  # then the combination used once


def test_a_filled_batch_of_an_axis_key_dispatches_to_it_and_is_timed(captured):
    from graphcap.testing import time_key
    from graphcap.workload import fill_batch

    m, _ = captured
    key = GraphKey(4, 4, True, (("lora", 2),))
    assert m.dispatch(fill_batch(key, m.config)) == key
    timing = time_key(m, key, steps=2, warmup=0)
    assert timing is not None and timing.key == key


def test_listed_combinations_are_all_that_is_captured_and_a_step_replays_one_that_holds_it():
    m = manager(**{"capture.sizes": [4], "capture.axis_combinations": [{"lora": 4}, {"lora": 1}]})
    report = m.capture()
    assert {lora_of(r.key) for r in report.records} == {1, 4} and len(report.records) == 4
    batch = lora_step([1, 1], [0, 2])  # 2 adapters: lora 2 is not listed, so the graph of 4 slots
    torch.testing.assert_close(m.execute(batch).clone(), m.eager(batch))
    assert lora_of(m.dispatch(batch)) == 4
