"""`graphcap.phase()` and `graphcap.is_capturing()`: what a model, its `prepare` and an engine buffer's check see.

The rule: a communicator that returns a placeholder outside a graph's
recording (vLLM's and SGLang's custom all-reduce during warmups) must be able to ask graphcap
whether a graph records now; with `capture_context` as its capture mode and verification after
the context exits, a model that asks replays correctly, and one that cannot ask fails capture.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import graphcap
from graphcap import BufferSpec, CaptureError, CaptureManager, StepBatch
from graphcap.phases import DUMMY_PHASES
from graphcap.probe import probe_batches_run, probe_fills
from graphcap.testing import make_config
from tests.distributed._models import CustomAllReduce

VOCAB, HIDDEN = 128, 16


class PhaseModel(torch.nn.Module):
    """A two-matrix model that logs (phase, is_capturing) at every forward and prepare it runs."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g), requires_grad=False)
        self.forwards: list[tuple[str, bool]] = []
        self.prepares: list[tuple[str, str]] = []

    def prepare(self, inputs, phase) -> None:
        self.prepares.append((phase, graphcap.phase()))

    def forward(self, inputs) -> torch.Tensor:
        self.forwards.append((graphcap.phase(), graphcap.is_capturing()))
        return self.emb[inputs.input_ids.long()] @ self.head


def batch(num_tokens: int, seed: int = 0, **extras) -> StepBatch:
    """Decodes up to 8 tokens (the largest captured size), else two prefill chunks (an eager step)."""
    rng = np.random.default_rng(seed)
    q = np.ones(num_tokens, np.int32) if num_tokens <= 8 else np.array([num_tokens // 2, num_tokens - num_tokens // 2])
    return StepBatch(q, q + 3, rng.integers(0, VOCAB, num_tokens), extras=extras or None)


def test_phase_is_outside_and_nothing_captures_outside_a_step():
    assert graphcap.phase() == "outside" and graphcap.is_capturing() is False


def test_each_forward_sees_its_phase_and_only_the_recording_sees_is_capturing():
    model = PhaseModel()
    manager = CaptureManager(model, make_config(), backend="emulated", progress=False)
    manager.capture()
    seen = Counter(model.forwards)
    keys = len(manager.graphs)
    assert seen[("capture", True)] == keys  # one recording per key, which runs the preflight's checks
    assert seen[("warmup", False)] == keys  # num_warmups: 1, no separate checked run
    # each probe batch's eager reference, one per distinct probe batch of the pass (the dummy's is the warmup's output)
    max_model_len = manager.config.kv_cache.max_model_len
    shapes = [manager.registry.capture_shape(key) for key in manager.registry.capture_order()]
    probes = sum(len(probe_fills(shape, max_model_len=max_model_len)) for shape in shapes)
    runs = sum(probe_batches_run(shapes, max_model_len=max_model_len).values())
    assert probes > runs > keys and seen[("verify", False)] == runs
    assert set(seen) == {("capture", True), ("warmup", False), ("verify", False)}
    model.forwards.clear()
    manager.execute(batch(3))  # a replay: the tape runs, not the Python forward
    manager.execute(batch(20))  # above the largest size: eager
    manager.eager(batch(3))
    assert model.forwards == [("eager", False), ("eager", False)]
    assert graphcap.phase() == "outside"


def test_prepare_and_an_engine_buffer_check_tell_a_dummy_step_from_a_real_one():
    checked: list[tuple[str, int]] = []

    def check(host_view, num_real_rows):
        checked.append((graphcap.phase(), num_real_rows))

    spec = BufferSpec("temperature", "reqs", dtype="float32", pad=1.0, check=check)
    model = PhaseModel()
    manager = CaptureManager(model, make_config(), backend="emulated", progress=False, buffers=[spec])
    manager.capture()
    assert {phase for phase, _ in checked} == {"capture", "verify"} <= DUMMY_PHASES
    assert {outer for _, outer in model.prepares} == {"capture", "verify"}
    checked.clear()
    model.prepares.clear()
    temperature = np.full(3, 0.5, np.float32)
    manager.execute(batch(3, temperature=temperature))
    manager.execute(batch(20, temperature=np.full(2, 0.5, np.float32)))
    assert checked == [("replay", 3), ("eager", 2)]
    assert model.prepares == [("replay", "replay"), ("eager", "eager")]


class OneRankAllReduce(CustomAllReduce):
    """The custom all-reduce of the multi-rank tests on one rank, with no group: its "sum" of two
    identical shards is twice the input, and its placeholder outside a recording is `zeros_like`."""

    def __init__(self, ask: str) -> None:
        super().__init__(None, ask)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2


class ReducedModel(PhaseModel):
    def __init__(self, ask: str) -> None:
        super().__init__()
        self.comm = OneRankAllReduce(ask)

    def forward(self, inputs) -> torch.Tensor:
        h = self.emb[inputs.input_ids.long()]
        return (h + self.comm.all_reduce(h)) @ self.head


def test_a_custom_all_reduce_that_asks_is_capturing_replays_the_reduced_forward():
    model = ReducedModel("graphcap")
    manager = CaptureManager(
        model, make_config(), backend="emulated", progress=False, capture_context=model.comm.capture
    )
    report = manager.capture()
    assert all(record.verified for record in report.records) and len(manager.graphs) == 6
    assert model.comm.placeholders == 6  # each key's warmup ran the placeholder, no recording did
    for n, padded in ((1, 2), (3, 4), (8, 8)):
        step = batch(n, seed=n)
        ids = torch.as_tensor(step.input_ids, dtype=torch.long)
        expected = (3 * model.emb[ids]) @ model.head
        torch.testing.assert_close(manager.execute(step), expected)
        assert manager.last_key == graphcap.GraphKey(padded, padded, True)  # a replay


def test_a_custom_all_reduce_that_cannot_tell_a_warmup_from_a_recording_fails_verification():
    # The captured graph holds the placeholder; verification runs after the capture context, with the
    # real all-reduce, and refuses the graph instead of replaying wrong output.
    model = ReducedModel("cuda")
    manager = CaptureManager(
        model, make_config(), backend="emulated", progress=False, capture_context=model.comm.capture
    )
    with pytest.raises(
        CaptureError, match=r"capturing uniform\(tokens=8, reqs=8\) failed: .*replay differs from eager"
    ):
        manager.capture()
    assert manager.graphs == {}


def test_capture_pending_stages_its_dummy_batches_in_the_capture_phase():
    model = PhaseModel()
    config = make_config(capture__strategy="lazy")
    manager = CaptureManager(model, config, backend="emulated", progress=False)
    assert manager.capture_pending(max_keys=2) == 2
    assert {outer for _, outer in model.prepares} == {"capture", "verify"} <= DUMMY_PHASES  # never "outside"
    assert graphcap.phase() == "outside"
