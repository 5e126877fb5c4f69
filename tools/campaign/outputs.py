"""Silent wrong output or shape: per-request outputs, whole engine buffers, stored values, the null block.

The checks `tests/reliability/test_outputs_and_buffers.py` runs a few times and
`tools/reliability.py` many times; each raises `AssertionError` saying what went wrong.

| check | what it proves |
|---|---|
| `check_output_rows` | an output declared per request (`LastTokenLogits`) has `num_reqs` rows, equal to eager |
| `check_wrong_cut_refused` | a per-request output undeclared or declared wrong is refused at capture, naming the fix |
| `check_whole_buffer` | a `none` engine buffer (`WholeBuffer`) reaches every key and step whole, equal to eager |
| `check_inf_refused` | a value a float buffer stores as inf (`INF_WHEN_STORED`) is refused, nothing written |
| `check_null_block_refused` | a real step or block-table write naming block 0 (`NULL_BLOCK_STEPS`) is refused |
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from graphcap.batch import StepBatch
from graphcap.capture.verification import assert_close
from graphcap.config import CaptureConfig
from graphcap.errors import BatchError, CaptureError, InvariantViolation
from graphcap.inputs import BufferSpec
from graphcap.keys import GraphKey
from graphcap.manager import CaptureManager
from graphcap.models import build_model
from graphcap.outputs import cloned
from graphcap.staging import PersistentBuffers
from graphcap.testing.faults import assert_unchanged, expect, snapshot

__all__ = [
    "DECLARED",
    "INF_WHEN_STORED",
    "NULL_BLOCK_STEPS",
    "WRONG",
    "LastTokenLogits",
    "WholeBuffer",
    "check_inf_refused",
    "check_null_block_refused",
    "check_output_rows",
    "check_whole_buffer",
    "check_wrong_cut_refused",
    "whole_spec",
]

DECLARED = {"tensor": "reqs", "tuple": {0: "tokens", 1: "reqs"}, "dict": {"hidden": "tokens", "logits": "reqs"}}
"""The right `output_rows` of each result `LastTokenLogits` returns."""
WRONG = {"tensor": "tokens", "tuple": {1: "tokens"}, "dict": {"logits": "tokens"}}
"""A wrong one: the per-request logits declared per token."""
_FIX = {
    "tensor": "output_rows = 'reqs'",
    "tuple": "output_rows = {1: 'reqs'}",
    "dict": "output_rows = {'logits': 'reqs'}",
}
_CHOICE = {
    "tensor": "output_rows = 'tokens' | 'reqs'",
    "tuple": "1: 'tokens' | 'reqs'}",
    "dict": "'logits': 'tokens' | 'reqs'}",
}
"""What a refusal with verification off offers for the logits (it cannot tell which is right)."""


class LastTokenLogits(torch.nn.Module):
    """The reference model returning hidden rows per token and each request's last-token logits, as
    engines sample: a tensor (the logits), a tuple (hidden, logits) or a dict of both."""

    def __init__(self, config: CaptureConfig, output_rows: Any = None, result: str = "dict") -> None:
        super().__init__()
        self.inner, self.result = build_model(config), result
        if output_rows is not None:
            self.output_rows = output_rows

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.inner.kv_cache

    def forward(self, inputs) -> Any:
        logits = self.inner(inputs)  # [T, vocab]
        last = logits.index_select(0, (inputs.query_start_loc[1:] - 1).clamp(min=0))  # [R, vocab]
        hidden = logits[:, :16] * 2  # [T, 16]
        if self.result == "tensor":
            return last
        return (hidden, last) if self.result == "tuple" else {"hidden": hidden, "logits": last}


def check_output_rows(manager: CaptureManager, batch: StepBatch) -> None:
    """`execute` of a `LastTokenLogits` manager (dict result, declared) gives `num_reqs` logits rows
    and `num_tokens` hidden rows, equal to `eager`."""
    got = cloned(manager.execute(batch))
    shapes = (got["logits"].shape[0], got["hidden"].shape[0])
    expect(
        shapes == (batch.num_reqs, batch.num_tokens), f"rows {shapes}, expected ({batch.num_reqs}, {batch.num_tokens})"
    )
    assert_close(got, manager.eager(batch))


def check_wrong_cut_refused(config: CaptureConfig, result: str, wrong: bool) -> None:
    """Capture of `LastTokenLogits` (undeclared, or `WRONG` when `wrong`) raises `CaptureError` naming
    the declaration to write, and leaves no graph."""
    manager = CaptureManager(LastTokenLogits(config, WRONG[result] if wrong else None, result), config, progress=False)
    fix = _FIX[result] if wrong or config.checks.verify_replay else _CHOICE[result]
    try:
        manager.capture()
    except CaptureError as exc:
        expect(fix in str(exc), f"refused without naming {fix}: {exc}")
    else:
        raise AssertionError(
            f"captured a per-request {result} output {'declared per token' if wrong else 'undeclared'}"
        )
    expect(not manager.graphs, "a refused capture left graphs")


class WholeBuffer(torch.nn.Module):
    """The reference model scaled by a `none` engine buffer `scale` of any shape, read whole."""

    def __init__(self, config: CaptureConfig, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.inner, self.seen = build_model(config), set()
        self.mix = torch.nn.Parameter(torch.randn(*shape, config.model.vocab_size), requires_grad=False)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.inner.kv_cache

    def forward(self, inputs) -> torch.Tensor:
        scale = inputs.extras["scale"]  # the whole tensor, whatever the key
        self.seen.add(tuple(scale.shape))
        return self.inner(inputs) * (scale.unsqueeze(-1) * self.mix).reshape(-1, self.mix.shape[-1]).sum(0)


def whole_spec(shape: tuple[int, ...]) -> BufferSpec:
    """A float32 `none` buffer `scale` of `shape`, sampled for capture's batches."""
    return BufferSpec(
        "scale", "none", shape=shape, dtype="float32", pad=1.0, sample=lambda rng, rows: rng.uniform(0.5, 2, shape)
    )


def check_whole_buffer(manager: CaptureManager, batch: StepBatch, rng: np.random.Generator) -> None:
    """A step of `batch` with its own `scale` values: the forward sees the whole buffer, replay == eager."""
    model: WholeBuffer = manager.model
    shape = tuple(model.mix.shape[:-1])
    value = rng.uniform(0.5, 2, shape).astype(np.float32)
    batch = StepBatch(batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table, extras={"scale": value})
    got = manager.execute(batch).clone()
    expect(model.seen == {shape}, f"the forward saw scale shaped {sorted(model.seen)}, expected {shape}")
    expect(manager.buffers.host["scale"].tolist() == value.tolist(), "the staged buffer is not the step's value")
    assert_close(got, manager.eager(batch))


INF_WHEN_STORED = (
    ("float16", 1e6),
    ("float16", 70000.0),
    ("float16", 65520.0),
    ("float16", -1e5),
    ("float16", 100000),
    ("float32", 1e39),
)
"""Finite values a buffer of that dtype stores as inf (an int too: 100000 is inf in float16)."""


def check_inf_refused(dtype: str, value: float) -> None:
    """Staging `value` into a `reqs` buffer of `dtype` raises `BatchError` naming the buffer, index and
    value, and writes nothing."""
    buffers = PersistentBuffers(4, 16, 3, block_size=4, extras=[BufferSpec("scale", "reqs", dtype=dtype, pad=1.0)])
    buffers.stage(StepBatch([1, 1], [2, 2]), GraphKey(4, 4, False))
    before = buffers.packed_host.copy()
    try:
        buffers.stage(StepBatch([1, 1], [2, 2], extras={"scale": np.array([0.5, value])}), GraphKey(4, 4, False))
    except BatchError as exc:
        pattern = (
            rf"extras\['scale'\]\[1\] is {re.escape(str(np.array([0.5, value])[1]))}, which {dtype} stores as -?inf"
        )
        expect(re.search(pattern, str(exc)) is not None, f"message does not name buffer, index and value: {exc}")
    else:
        raise AssertionError(f"{value!r} staged into a {dtype} buffer")
    expect(buffers.packed_host.tobytes() == before.tobytes(), "a refused value wrote the buffers")


class NullStep(NamedTuple):
    """A real step, or a write of the persistent block table, that names the null block."""

    name: str
    run: Callable[[CaptureManager], Any]
    match: str


def _steps(name: str, query_lens: list[int], seq_lens: list[int], table: list[list[int]], match: str) -> list[NullStep]:
    batch = StepBatch(query_lens, seq_lens, list(range(1, 1 + sum(query_lens))), table)
    return [
        NullStep(f"{name} (execute)", lambda manager: manager.execute(batch), match),
        NullStep(f"{name} (eager)", lambda manager: manager.eager(batch), match),
    ]


NULL_BLOCK_STEPS = (
    *_steps("a context block", [1, 1], [5, 6], [[0, 2], [3, 4]], r"block_table\[0, 0\] is 0, .*request 0 reads"),
    *_steps("a written block", [1, 1], [5, 6], [[1, 0], [3, 4]], r"slot_mapping\[0\] is 0, .*in block 0"),
    *_steps("a prefill's second block", [6], [6], [[5, 0]], r"slot_mapping\[4\] is 0, .*in block 0"),
    NullStep("set_row(0, [0])", lambda m: m.block_table.set_row(0, [0]), r"set_row\(row 0\): block id 0 .* null block"),
    NullStep("append(0, [4, 0])", lambda m: m.block_table.append(0, [4, 0]), r"append\(row 0\): block id 0 at index 1"),
)
"""For the TINY config (4-token blocks, invariants `full`): each must be refused."""


def check_null_block_refused(manager: CaptureManager, case: NullStep) -> None:
    """`case` raises `InvariantViolation` or `BatchError` matching its message, before any KV-cache write
    (a refused table write changes no buffer either)."""
    before = snapshot(manager)
    try:
        case.run(manager)
    except (InvariantViolation, BatchError) as exc:
        expect(re.search(case.match, str(exc)) is not None, f"message does not match {case.match!r}: {exc}")
        assert_unchanged(manager, before, buffers=isinstance(exc, BatchError))
    else:
        raise AssertionError(f"{case.name} naming the null block was accepted")
