"""An eager op without a `capturable=` twin inside a full graph: a capture-unsafe body is refused naming the
op, `capturable=` and mode `piecewise` (not a bare ".item() reads a tensor value"), and mode `piecewise`
then captures the same model and replays it equal to eager."""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureManager, CaptureUnsafeError, current_inputs, eager_op
from graphcap.models import build_model
from graphcap.testing import Workload, Wrapped, make_config


@eager_op
def scale_by_first_request(x: torch.Tensor) -> torch.Tensor:
    first = int(current_inputs().query_start_loc[1].item())  # a host read: fine eagerly, never in a graph
    return x * first


class _Model(Wrapped):
    def reset_kv_cache(self) -> None:
        self.inner.reset_kv_cache()

    def forward(self, inputs) -> torch.Tensor:
        return scale_by_first_request(self.inner(inputs))


def _manager(mode: str) -> CaptureManager:
    config = make_config({"capture.sizes": [2, 4], "capture.mode": mode, "model.attention": "per_request"})
    return CaptureManager(_Model(build_model(config)), config, backend="emulated", progress=False)


def test_a_full_graph_refuses_an_unsafe_eager_op_naming_it_and_mode_piecewise_captures_it():
    manager = _manager("full_and_piecewise")
    with pytest.raises(CaptureUnsafeError) as caught:
        manager.capture()
    message = str(caught.value)
    assert caught.value.op == "Tensor.item" and "test_eager_op_in_full_graphs.py:" in caught.value.location
    assert "it runs inside eager_op(scale_by_first_request), which a full graph" in message
    assert "eager_op(capturable=...)" in message and "capture.mode: piecewise" in message

    manager = _manager("piecewise")  # the fix the message gives: the op runs eagerly between pieces
    report = manager.capture()
    assert all(r.status == "captured" and r.verified for r in report.records)
    workload = Workload(manager.config, seed=1)
    for _ in range(2):
        workload.add_random(6)
    batch = workload.next_batch(max_tokens=4)
    replayed = manager.execute(batch).clone()
    assert manager.last_key in manager.graphs
    torch.testing.assert_close(replayed, manager.eager(batch))
