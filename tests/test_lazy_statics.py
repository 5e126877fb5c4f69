"""Lazy capture never mixes graphs that read different static inputs.

Under `capture.strategy: lazy` graphs join the live ones over time. A static input changed between two
`capture_pending` calls (an object replaced in its slot, a storage swapped with `.data =`, a
`register_static` name registered again) would leave later graphs reading the new tensor and earlier
ones the captured tensor: once the captured one is put back, the later graphs return wrong output with no
error. `capture_pending` refuses (`StaticInputMovedError`, naming the input) while any static input differs
from what the live graphs captured; following the refusal's advice keeps every replay equal to eager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcap import CaptureError, CaptureManager, StaticInputMovedError, StepBatch
from graphcap.checks.guard import StaticGuard
from graphcap.models import build_model
from graphcap.testing import FaultyModel, make_config, make_manager

LAZY = {"capture.strategy": "lazy"}
QUERIES = [[1], [1, 1, 1], [1] * 5, [1] * 8, [2], [2, 1], [3, 2, 2], [1, 1, 1, 1, 4]]
"""Query lengths of steps that reach every key of the tiny config: uniform decode and mixed, 2, 4 and 8 tokens."""


def _batch(q: list[int], seed: int) -> StepBatch:
    rng = np.random.default_rng(seed)
    q = np.array(q)
    seq = q + rng.integers(0, 12, len(q))
    table = np.arange(1, 1 + len(q) * 8, dtype=np.int32).reshape(len(q), 8)
    return StepBatch(q, seq, rng.integers(0, 128, int(q.sum())), table)


def _assert_every_key_equals_eager(manager: CaptureManager) -> None:
    replayed = set()
    for seed, q in enumerate(QUERIES):
        batch = _batch(q, seed)
        out = manager.execute(batch).clone()
        replayed.add(manager.last_key)
        torch.testing.assert_close(out, manager.eager(batch))
    assert replayed == set(manager.graphs), "every captured key replayed"


def _largest_difference(manager: CaptureManager) -> float:
    worst = 0.0
    for seed, q in enumerate(QUERIES):
        batch = _batch(q, seed)
        worst = max(worst, float((manager.execute(batch) - manager.eager(batch)).abs().max()))
    return worst


def _one_key_captured() -> CaptureManager:
    manager = make_manager(make_config(LAZY))
    assert manager.capture_pending(max_keys=1) == 1
    return manager


def _replace(model) -> torch.nn.Parameter:
    captured = model.lm_head
    model.lm_head = torch.nn.Parameter(captured.detach().clone() * 2, requires_grad=False)  # a LoRA merge, a sync
    return captured


def test_object_replaced_then_put_back_capture_pending_refuses_in_between_and_every_key_equals_eager():
    manager = _one_key_captured()
    captured = _replace(manager.model)
    with pytest.raises(
        StaticInputMovedError, match=r"capture_pending\(\): refused to capture: parameter 'model\.lm_head' was replaced"
    ) as info:
        manager.capture_pending()
    assert info.value.input_name == "model.lm_head"
    assert len(manager.graphs) == 1  # nothing captured
    manager.model.lm_head = captured  # what the message advises first
    assert manager.capture_pending() == 5
    _assert_every_key_equals_eager(manager)


def test_canary_without_the_refusal_keys_captured_after_the_swap_replay_the_other_weight(monkeypatch):
    manager = _one_key_captured()
    captured = _replace(manager.model)
    monkeypatch.setattr(StaticGuard, "check_before_capture", lambda *args: None)
    assert manager.capture_pending() == 5  # reading the replacement
    manager.model.lm_head = captured
    assert _largest_difference(manager) > 0.1, "the hazard: silent wrong output from the keys captured in between"


def test_storage_swapped_with_data_then_put_back_is_refused_in_between_and_every_key_equals_eager():
    manager = _one_key_captured()
    weight = manager.model.lm_head
    saved = weight.data
    weight.data = saved.clone() * 2
    with pytest.raises(StaticInputMovedError, match=r"refused to capture: static input 'model\.lm_head' moved"):
        manager.capture_pending()
    assert len(manager.graphs) == 1
    weight.data = saved
    assert manager.capture_pending() == 5
    _assert_every_key_equals_eager(manager)


def test_copy_in_then_in_place_update_keeps_every_key_equal_to_eager():
    manager = _one_key_captured()
    captured = _replace(manager.model)
    with pytest.raises(StaticInputMovedError, match="lm_head"):
        manager.capture_pending()
    with torch.no_grad():
        captured.copy_(manager.model.lm_head)  # the new values into the captured tensor ...
    manager.model.lm_head = captured  # ... and the captured object back
    assert manager.capture_pending() == 5
    _assert_every_key_equals_eager(manager)
    with torch.no_grad():
        captured.mul_(-1.5)  # a later in-place update: every graph reads it
    _assert_every_key_equals_eager(manager)


def test_recapture_after_a_replacement_captures_every_key_against_the_new_weight():
    manager = _one_key_captured()
    _replace(manager.model)
    with pytest.raises(StaticInputMovedError, match=r"capture\(\) again \(under capture\.strategy: lazy"):
        manager.capture_pending()
    manager.capture()  # lazy: releases the graphs; every key pending again
    assert manager.capture_pending() == 6
    _assert_every_key_equals_eager(manager)


class Scaled(torch.nn.Module):
    """The reference model with its logits scaled by a tensor that only `register_static` names."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.holder = {"scale": torch.full((1,), 1.5)}  # a dict attribute of a module: not reached

    def forward(self, inputs):
        return self.inner(inputs) * self.holder["scale"]


def _registered_manager() -> tuple[CaptureManager, Scaled]:
    config = make_config(LAZY)
    model = Scaled(build_model(config))
    manager = CaptureManager(model, config, progress=False)
    manager.register_static("scale", model.holder["scale"])
    assert manager.capture_pending(max_keys=1) == 1
    return manager, model


def test_register_static_registered_again_then_back_is_refused_in_between_and_every_key_equals_eager():
    manager, model = _registered_manager()
    captured = model.holder["scale"]
    model.holder["scale"] = torch.full((1,), -3.0)
    manager.register_static("scale", model.holder["scale"])
    with pytest.raises(StaticInputMovedError, match=r"refused to capture: static input 'static\.scale' was registered"):
        manager.capture_pending()
    assert len(manager.graphs) == 1
    model.holder["scale"] = captured
    manager.register_static("scale", captured)
    assert manager.capture_pending() == 5
    _assert_every_key_equals_eager(manager)


def test_canary_register_static_without_the_refusal_differs(monkeypatch):
    manager, model = _registered_manager()
    captured = model.holder["scale"]
    model.holder["scale"] = torch.full((1,), -3.0)
    manager.register_static("scale", model.holder["scale"])
    monkeypatch.setattr(StaticGuard, "check_before_capture", lambda *args: None)
    monkeypatch.setattr(StaticGuard, "add_read", lambda *args: None)  # nor the recorded reads guarded
    manager.capture_pending()
    model.holder["scale"] = captured
    manager.register_static("scale", captured)
    assert _largest_difference(manager) > 0.1


def test_a_tensor_added_between_captures_is_recorded_and_its_replacement_refused():
    manager = _one_key_captured()
    model = manager.model
    model.register_buffer("extra", torch.zeros(1))  # appears after the first graph
    assert manager.capture_pending() == 5
    model.extra = torch.ones(1)
    with pytest.raises(StaticInputMovedError, match=r"buffer 'model\.extra' was replaced"):
        manager.execute(_batch([1], 0))


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_swap_after_the_first_keys_failed_with_no_graph_alive_is_captured_against_the_new_weight(on_error):
    config = make_config(LAZY, capture__on_error=on_error)
    model = FaultyModel(build_model(config))
    manager = CaptureManager(model, config, progress=False)
    model.arm(8, lambda: RuntimeError("injected fault"), uniform=True)  # the first key taken: uniform 8
    if on_error == "skip":
        assert manager.capture_pending(max_keys=1) == 0
    else:
        with pytest.raises(CaptureError, match=r"capturing uniform\(tokens=8, reqs=8\) failed"):
            manager.capture_pending(max_keys=1)
    model.disarm()
    assert not manager.graphs
    _replace(model.inner)  # nothing reads the captured weight: no graph is alive
    assert manager.capture_pending() == (5 if on_error == "skip" else 6)
    _assert_every_key_equals_eager(manager)
