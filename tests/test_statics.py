"""A model that is not an `nn.Module` is guarded through what it reaches (`graphcap.checks.statics.reach`).

The README's model is "anything with a forward": a runner holding modules, tensors and lists of
them as attributes. Replacing any of them after capture is refused by name (it used to replay
stale weights silently, even after `register_static` of every inner parameter).
"""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureManager, StaticInputMovedError, StepBatch
from graphcap.checks.statics import MAX_DEPTH, reach
from graphcap.testing import make_config

BATCH = StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]])
VOCAB, WIDTH = 128, 8  # TINY's vocabulary


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Parameter(torch.randn(VOCAB, WIDTH), requires_grad=False)


class Settings:
    """A plain object on the way to a tensor."""

    def __init__(self) -> None:
        self.scale = torch.full((WIDTH,), 0.5)


class Runner:
    """Not an nn.Module: an engine's model runner holding a module, a tensor, a list and a plain object."""

    def __init__(self) -> None:
        self.inner = Inner()
        self.bias = torch.linspace(-1, 1, WIDTH)
        self.caches = [torch.linspace(0, 1, 72 * 4)]  # TINY's cache: 72 blocks of 4 slots
        self.settings = Settings()
        self.name = "runner"

    def forward(self, inputs) -> torch.Tensor:
        rows = self.inner.lm_head.index_select(0, inputs.input_ids.long())  # [T, WIDTH]
        slots = inputs.slot_mapping.long().clamp(min=0)
        read = self.caches[0].index_select(0, slots)[:, None]  # [T, 1]
        return rows * self.settings.scale + self.bias + read


def runner_manager() -> tuple[CaptureManager, Runner]:
    runner = Runner()
    manager = CaptureManager(runner, make_config(), progress=False)
    manager.register_static("lm_head", runner.inner.lm_head)  # registering every weight did not help before
    manager.capture()
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))
    return manager, runner


def test_reach_of_a_runner_names_its_tensors_and_the_objects_on_the_way():
    runner = Runner()
    names = [r.name for r in reach(runner, {}, {})]
    assert names == [
        "model.inner",
        "model.inner.lm_head",
        "model.bias",
        "model.caches",
        "model.caches.0",
        "model.settings",
        "model.settings.scale",
    ]


def test_reach_stops_at_graphcaps_own_objects_and_at_the_depth_limit():
    runner = Runner()
    runner.manager = CaptureManager(Runner(), make_config(), progress=False)  # an engine keeps its manager
    deep = runner
    for _ in range(MAX_DEPTH + 1):
        deep.next = Settings()
        deep = deep.next
    names = [r.name for r in reach(runner, {}, {})]
    assert not any(name.startswith("model.manager") for name in names)
    assert f"model{'.next' * MAX_DEPTH}.scale" in names
    assert f"model{'.next' * (MAX_DEPTH + 1)}.scale" not in names


@pytest.mark.parametrize(
    ("move", "match"),
    [
        (
            lambda r: setattr(r.inner, "lm_head", torch.nn.Parameter(r.inner.lm_head * 2, requires_grad=False)),
            r"parameter 'model\.inner\.lm_head' was replaced",
        ),
        (lambda r: setattr(r, "inner", Inner()), r"attribute 'model\.inner' was replaced"),
        (lambda r: setattr(r, "bias", r.bias * 2), r"attribute 'model\.bias' was replaced"),
        (lambda r: r.caches.__setitem__(0, r.caches[0] * 2), r"item 'model\.caches\.0' was replaced"),
        (lambda r: setattr(r.settings, "scale", r.settings.scale * 2), r"'model\.settings\.scale' was replaced"),
        (lambda r: setattr(r.bias, "data", r.bias * 2), r"'model\.bias' moved after capture"),
    ],
    ids=["inner_weight", "inner_module", "tensor_attribute", "list_item", "plain_object_attribute", "data_swap"],
)
def test_replacing_what_a_plain_runner_reaches_is_refused_by_name(move, match):
    manager, runner = runner_manager()
    move(runner)
    with pytest.raises(StaticInputMovedError, match=match):
        manager.execute(BATCH)


def test_a_runners_weight_put_back_is_accepted():
    manager, runner = runner_manager()
    captured = runner.inner.lm_head
    runner.inner.lm_head = torch.nn.Parameter(captured * 2, requires_grad=False)
    with pytest.raises(StaticInputMovedError, match=r"'model\.inner\.lm_head'"):
        manager.execute(BATCH)
    runner.inner.lm_head = captured
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))
