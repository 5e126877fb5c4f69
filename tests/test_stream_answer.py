"""`torch.cuda.is_current_stream_capturing()` on the emulated backend: False outside its recording (a CPU-only
build of torch raises there on its own), True inside it, torch's own function again once no backend lives."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import graphcap
from graphcap import CaptureManager, StepBatch
from graphcap.models import build_model
from graphcap.testing import make_config

CPU_ONLY = not torch.backends.cuda.is_built()


class GuardedModel(torch.nn.Module):
    """The reference model behind a CUDA engine's usual guard: capture-only code runs only on a capturing stream."""

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.answers: list[tuple[bool, bool]] = []  # (the stream's answer, graphcap.is_capturing()) per forward

    def forward(self, inputs) -> torch.Tensor:
        capturing = torch.cuda.is_current_stream_capturing()
        self.answers.append((capturing, graphcap.is_capturing()))
        return self.llama(inputs)


def _run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: no emulated backend of another test lives there."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not CPU_ONLY, reason="a CUDA build answers on its own")
def test_canary_a_cpu_build_of_torch_raises_where_no_emulated_backend_lives():
    result = _run("import torch, graphcap; torch.cuda.is_current_stream_capturing()")
    assert result.returncode != 0 and "RuntimeError" in result.stderr


def test_a_guarded_forward_warms_up_captures_and_steps_answered_false_except_while_recording():
    config = make_config({"capture.sizes": [2, 4]})
    model = GuardedModel(config)
    manager = CaptureManager(model, config, progress=False)
    report = manager.capture()  # on a CPU build, the guard raised at the first warmup
    assert report.records and all(record.verified for record in report.captured)
    rng = np.random.default_rng(0)
    batch = StepBatch([1, 1, 1], [3, 5, 7], rng.integers(0, 128, 3), np.arange(1, 25).reshape(3, 8))
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    assert all(stream == recording for stream, recording in model.answers)  # True exactly while the tape records
    assert sum(stream for stream, _ in model.answers) == len(report.captured)  # one recording per key
    assert not torch.cuda.is_current_stream_capturing() and not torch.cuda.graphs.is_current_stream_capturing()


def test_torchs_own_function_is_back_once_the_last_emulated_backend_is_gone():
    code = """
import gc, torch
from graphcap.backends.emulated import EmulatedBackend
own = torch.cuda.is_current_stream_capturing
first, second = EmulatedBackend("cpu"), EmulatedBackend("cpu")
assert torch.cuda.is_current_stream_capturing is not own
del first; gc.collect()
assert torch.cuda.is_current_stream_capturing is not own and not torch.cuda.is_current_stream_capturing()
del second; gc.collect()
assert torch.cuda.is_current_stream_capturing is own and torch.cuda.graphs.is_current_stream_capturing is own
print("restored")
"""
    result = _run(code)
    assert result.returncode == 0 and result.stdout.strip() == "restored", result.stderr
