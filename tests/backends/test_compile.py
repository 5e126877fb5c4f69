"""torch.compile and capture: the checked preflight never poisons compilation, and a backend
that captures compiled code uncompiled (the emulated one always does) says so, never silently."""

from __future__ import annotations

import warnings

import pytest
import torch

from graphcap import CaptureManager
from graphcap.testing import make_config


class CountingBackend:
    """A torch.compile backend that counts compilations and runs of the compiled code."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def _scaled_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2 + 1


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_emulated_capture_warns_and_the_compiled_function_keeps_compiling(emulated, fullgraph):
    backend = CountingBackend()
    compiled = torch.compile(_scaled_relu, backend=backend, fullgraph=fullgraph)
    x = torch.randn(8)
    emulated.warmup(lambda: compiled(x), num_warmups=1)
    # The preflight ran it uncompiled (stance force_eager), the plain warmup compiled and ran it:
    # a dispatch mode met first would have marked it "skip" for good (fullgraph: an error).
    assert (backend.compiled, backend.runs) == (1, 1)
    with pytest.warns(UserWarning, match=r"captured key without torch\.compile: _scaled_relu \(.*test_compile\.py:"):
        graph = emulated.capture(lambda: compiled(x), {"x": x}, name="key")
    assert len(graph.uncompiled) == 1 and graph.uncompiled[0].startswith("_scaled_relu (")
    assert backend.runs == 1  # the tape holds the uncompiled aten ops
    x.copy_(torch.randn(8))
    torch.testing.assert_close(graph.replay(), _scaled_relu(x))
    with torch.inference_mode():
        compiled(x)
    assert (backend.compiled, backend.runs) == (1, 2)  # eager steps still run the compiled code


def test_a_forward_without_compiled_code_captures_without_a_warning(emulated):
    x = torch.randn(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = emulated.capture(lambda: _scaled_relu(x), {"x": x}, name="key")
    assert graph.uncompiled == ()


class _CompiledModel(torch.nn.Module):
    def __init__(self, backend: CountingBackend) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 16)
        self._step = torch.compile(self._logits, backend=backend)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids.long()) @ self.embed.weight.t()

    def forward(self, inputs) -> torch.Tensor:
        return self._step(inputs.input_ids)


def test_the_capture_report_says_compiled_code_was_captured_uncompiled():
    backend = CountingBackend()
    config = make_config({"capture.sizes": [2, 4], "capture.mode": "full_decode_only"})
    manager = CaptureManager(_CompiledModel(backend), config, backend="emulated", progress=False)
    with pytest.warns(UserWarning, match="without torch.compile"):
        report = manager.capture()
    assert len(report.captured) == 2 and all(r.verified for r in report.captured)
    (warning,) = report.warnings
    assert "torch.compile was off while the emulated backend captured: _CompiledModel._logits" in warning
    assert report.to_dict()["warnings"] == [warning] and f"warning: {warning}" in report.summary()
    assert backend.compiled >= 1 and backend.runs >= 2  # warmups and verification ran compiled


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_a_compiled_submodule_still_compiles_after_a_piecewise_capture(fullgraph):
    # The plain warmups of a piecewise key must run with no dispatch mode: a compiled function
    # first called under one never compiles (fullgraph=True: it raises on every later call).
    from graphcap.testing import Workload

    config = make_config({"capture.sizes": [2, 4], "capture.mode": "piecewise", "model.attention": "per_request"})
    from graphcap.models import build_model

    model = build_model(config)
    counting = CountingBackend()
    layer = model.layers[0]
    layer.project_qkv = torch.compile(layer.project_qkv, backend=counting, fullgraph=fullgraph)
    manager = CaptureManager(model, config, backend="emulated", progress=False)
    with pytest.warns(UserWarning, match="without torch.compile"):  # the emulated tape holds aten ops
        report = manager.capture()
    assert [r.status for r in report.records] == ["captured", "captured"]
    assert counting.compiled >= 1  # the plain warmups compiled it
    runs = counting.runs
    workload = Workload(config, seed=0)
    workload.add_random(8)
    manager.eager(workload.next_batch())
    assert counting.runs > runs  # an eager step runs the compiled code
