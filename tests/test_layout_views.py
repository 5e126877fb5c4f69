"""A forward that changes a staged view in place does not break later captures (`PackedLayout.restore_views`).

Staging hands every step and capture of one padded shape the same cached views. A forward that
ran `resize_` or `set_` on one of them (a bug, fixed later) used to leave it broken for good:
every later capture of that shape failed, the model fixed or not.
"""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureManager, StepBatch
from graphcap.models import build_model
from graphcap.testing import make_config

BATCH = StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]])
BREAKS = {
    "resize_shrink": lambda t: t.resize_(max(t.shape[0] - 1, 0)),
    "resize_grow": lambda t: t.resize_(t.shape[0] * 4),
    "set_": lambda t: t.set_(torch.zeros_like(t)),
}


class Careless(torch.nn.Module):
    """The reference model, whose forward breaks `inputs.input_ids` in place until `fixed`."""

    def __init__(self, config, how: str) -> None:
        super().__init__()
        self.inner, self.how, self.fixed = build_model(config), how, False

    def forward(self, inputs) -> torch.Tensor:
        if not self.fixed:
            BREAKS[self.how](inputs.input_ids)
        return self.inner(inputs)


@pytest.mark.parametrize("how", sorted(BREAKS))
def test_a_fixed_model_captures_every_key_again_after_a_forward_broke_a_staged_view(how, caplog):
    config = make_config(capture__on_error="skip")
    model = Careless(config, how)
    manager = CaptureManager(model, config, progress=False)
    manager.capture()  # some keys fail or capture garbage: the model is broken
    model.fixed = True
    report = manager.capture()
    assert [r.status for r in report.records] == ["captured"] * len(report.records)
    assert "put the views back" in caplog.text
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))
