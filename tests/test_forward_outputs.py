"""A forward may return a tensor, a tuple or a dict of tensors; execute/eager cut token rows to the real ones."""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureError, CaptureManager, StepBatch
from graphcap.models import build_model
from graphcap.testing import make_config

BATCH = StepBatch([2, 1], [3, 4], [5, 6, 7], [[1], [2]])  # 3 tokens: pads to 4


class Outputs(torch.nn.Module):
    """The reference model, returning its logits with other results the way engines do."""

    def __init__(self, config, shape: str) -> None:
        super().__init__()
        self.inner, self.shape = build_model(config), shape
        self.register_buffer("pooled_weight", torch.linspace(0, 1, config.model.vocab_size), persistent=False)

    def forward(self, inputs):
        logits = self.inner(inputs)  # [T, vocab]
        hidden = logits[:, :16] * 2  # [T, 16], a token-row result
        pooled = (logits[:1] * self.pooled_weight).sum(1)  # [1]: the first (always real) row, not a token row
        if self.shape == "tuple":
            return hidden, logits, pooled
        if self.shape == "dict":
            return {"hidden": hidden, "logits": logits, "pooled": pooled}
        return self.shape  # a bad return value, for the error test


@pytest.mark.parametrize("shape", ["tuple", "dict"])
def test_structured_outputs_replay_equal_to_eager_with_token_rows_cut(shape):
    config = make_config()
    manager = CaptureManager(Outputs(config, shape), config, progress=False)
    report = manager.capture()
    assert all(r.verified for r in report.records)  # verification compares every tensor
    got = manager.execute(BATCH)
    assert manager.last_key.num_tokens == 4
    got = tuple(got.values()) if shape == "dict" else got
    hidden, logits, pooled = (t.clone() for t in got)
    assert hidden.shape == (3, 16) and logits.shape == (3, 128)  # token rows: the real ones
    assert pooled.shape == (1,)  # not a token row: whole
    want = manager.eager(BATCH)
    want = tuple(want.values()) if shape == "dict" else want
    for g, w in zip((hidden, logits), want[:2]):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    ("returned", "match"),
    [(None, "returned NoneType"), ([1, 2], "returned a list of int"), ({}, "returned a dict of nothing")],
)
def test_a_forward_returning_no_tensor_is_refused_naming_what_it_returned(returned, match):
    config = make_config(capture__sizes=[2])
    manager = CaptureManager(Outputs(config, returned), config, progress=False)
    with pytest.raises(CaptureError, match=rf"capturing .* failed: .*{match}; it must return a torch\.Tensor"):
        manager.capture()
