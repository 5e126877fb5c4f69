"""An engine's torch function modes see none of graphcap's per-step host work (`graphcap.torch_modes`).

Engines serve with a torch function mode on (`torch.set_default_device("cuda")`, `torch.device(...)` context
managers). A mode sees every torch call made under it, in Python; a replayed step's own work (staging, the
invariants, the guard's sweeps, the replay, the output cut) must make none, so the mode neither slows it nor
sees it. Only the model's own code (`prepare`, the ops `eager_op` runs) may.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import graphcap
import graphcap.checks.guard
import graphcap.torch_modes
from graphcap import StepBatch
from graphcap.keys import GraphKey
from graphcap.testing import make_config, make_manager
from graphcap.workload import fill_batch

PACKAGE = Path(graphcap.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent
MODELS = PACKAGE / "models"


class Counting(TorchFunctionMode):
    """Counts each torch call by the first frame outside torch that made it: graphcap's, or anyone else's."""

    def __init__(self) -> None:
        super().__init__()
        self.graphcap: Counter[str] = Counter()
        self.others = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and Path(frame.f_code.co_filename).resolve().is_relative_to(TORCH):
            frame = frame.f_back
        origin = Path(frame.f_code.co_filename).resolve() if frame is not None else None
        if origin is not None and origin.is_relative_to(PACKAGE) and not origin.is_relative_to(MODELS):
            self.graphcap[f"{origin.relative_to(PACKAGE)}:{frame.f_lineno} {getattr(func, '__name__', func)}"] += 1
        else:  # the model's own forward, prepare and eager ops (graphcap.models is a model)
            self.others += 1
        return func(*args, **(kwargs or {}))


def _replayed(mode: str, invariants: str = "basic"):
    """A captured manager and a step it replays (run once already: every plan cached)."""
    attention = {"model.attention": "per_request"} if mode == "piecewise" else {}  # attention in an eager_op
    config = make_config(attention, capture__mode=mode, checks__invariants=invariants, checks__verify_replay=False)
    manager = make_manager(config)
    manager.capture()
    batch = fill_batch(GraphKey(4, 4, True), config, np.random.default_rng(0), 3)
    manager.execute(batch)
    return manager, batch


@pytest.mark.parametrize("invariants", ["off", "basic", "full"])
def test_a_replayed_full_graph_step_makes_no_torch_call_an_engines_mode_sees(invariants):
    manager, batch = _replayed("full", invariants)
    expected = manager.execute(batch).clone()
    counting = Counting()
    with counting:
        replayed = manager.execute(batch).clone()
    assert manager.last_key == GraphKey(4, 4, True)
    assert dict(counting.graphcap) == {}
    assert counting.others == 1  # the test's own clone(): the mode counts what it sees
    torch.testing.assert_close(replayed, expected)


def test_a_piecewise_step_makes_torch_calls_only_in_the_models_eager_ops():
    manager, _ = _replayed("piecewise")
    batch = StepBatch([2, 1], [5, 3], input_ids=[7, 8, 9], block_table=[[3, 5], [4, 0]])
    manager.execute(batch)
    expected = manager.execute(batch).clone()
    counting = Counting()
    with counting:
        replayed = manager.execute(batch)
    assert manager.stats.piecewise_replays == 4 and manager.last_key == GraphKey(4, None, False)
    assert dict(counting.graphcap) == {}
    assert counting.others > 0  # the attention an eager_op runs, under the engine's mode as it expects
    torch.testing.assert_close(replayed.clone(), expected)


def test_the_step_under_set_default_device_matches_the_step_without_it():
    manager, batch = _replayed("full")
    expected = manager.execute(batch).clone()
    torch.set_default_device("cpu")
    try:
        replayed = manager.execute(batch).clone()
    finally:
        torch.set_default_device(None)
    torch.testing.assert_close(replayed, expected)


def test_canary_the_guard_with_torch_function_on_is_seen_by_the_mode(monkeypatch):
    """Without `no_torch_function` around its sweeps the guard's data_ptr calls reach the mode."""
    manager, batch = _replayed("full")
    monkeypatch.setattr(graphcap.checks.guard, "no_torch_function", graphcap.torch_modes.contextlib.nullcontext)
    counting = Counting()
    with counting:
        manager.execute(batch)
    assert any("checks/guard.py" in where and "data_ptr" in where for where in counting.graphcap)


def test_no_torch_function_turns_modes_off_on_this_torch():
    assert graphcap.torch_modes.TORCH_FUNCTION_OFF
    counting = Counting()
    t = torch.zeros(2)
    with counting:
        with graphcap.torch_modes.no_torch_function():
            t.data_ptr()
            t[:1]
        t.data_ptr()
    assert counting.others == 1
