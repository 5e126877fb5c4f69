"""A failed capture names the run it failed in and the real counts of the batch that run had.

A forward can fail in a warmup of the key's dummy batch, in its recording, or in verification: a replay or
its eager reference, on the dummy batch or on a probe batch of fewer real tokens and requests than the key.
The message names which, with the batch's own counts (a failure at 4 real tokens while verifying a key of 8
is not a failure of 8). A replay that differs from eager is told apart by its type (`ReplayMismatchError`),
never by its words.
"""

from __future__ import annotations

import pytest

import graphcap
from graphcap import CaptureError, CaptureManager
from graphcap.capture.outcome import KeyOutcome
from graphcap.errors import ReplayMismatchError
from graphcap.keys import GraphKey
from graphcap.models import build_model
from graphcap.testing import Wrapped, make_config

KEY = r"capturing uniform\(tokens=8, reqs=8\) failed: RuntimeError: boom"


class FailsWhen(Wrapped):
    """The reference model, raising `RuntimeError(message)` on a forward `when(inputs)` picks."""

    def __init__(self, inner, when, message: str = "boom") -> None:
        super().__init__(inner)
        self.when, self.message = when, message

    def forward(self, inputs):
        if self.when(inputs):
            raise RuntimeError(self.message)
        return self.inner(inputs)


def _manager(when, message: str = "boom", **overrides) -> CaptureManager:
    config = make_config({"capture.sizes": [8], **overrides})
    return CaptureManager(FailsWhen(build_model(config), when, message), config, progress=False)


def _probe_eager(inputs) -> bool:
    """The eager reference run of a 4-token probe batch: its key is the batch's own (unpadded, mixed)."""
    return graphcap.phase() == "verify" and inputs.key == GraphKey(4, 4, False)


@pytest.mark.parametrize(
    ("when", "where"),
    [
        (lambda inputs: graphcap.phase() == "warmup", r"a warmup run of its dummy batch \(8 tokens, 8 requests\)"),
        (lambda inputs: graphcap.is_capturing(), r"the recording of its dummy batch \(8 tokens, 8 requests\)"),
        (_probe_eager, "the eager reference run of a probe batch of 4 tokens and 4 requests"),
    ],
    ids=["warmup", "recording", "probe_eager_reference"],
)
def test_a_failure_names_its_run_and_the_batch_s_real_counts(when, where):
    with pytest.raises(CaptureError, match=rf"^{KEY}; it failed in {where}$"):
        _manager(when).capture()


def test_a_skipped_key_s_reason_names_them_too():
    report = _manager(_probe_eager, **{"capture.on_error": "skip"}).capture()
    reasons = {str(r.key): r.reason for r in report.records if r.status == "skipped"}
    assert reasons["uniform(tokens=8, reqs=8)"] == (
        "RuntimeError: boom; it failed in the eager reference run of a probe batch of 4 tokens and 4 requests"
    )


def test_a_failure_whose_words_read_like_a_mismatch_is_no_mismatch():
    # A capture context makes a real mismatch's reason explain placeholders: a failure that only says the words
    # gets no such hint (its type decides, not its message).
    manager = _manager(_probe_eager, "replay differs from eager", **{"capture.on_error": "skip"})
    manager.capturer.parts.failures.context = "capture_context"
    report = manager.capture()
    (reason,) = {r.reason for r in report.records if r.status == "skipped" and r.key.uniform}
    assert reason.startswith("RuntimeError: replay differs from eager; it failed in the eager reference run")
    assert "capture_context" not in reason


def test_a_mismatch_is_a_replay_mismatch_error_naming_the_batch():
    config = make_config({"capture.sizes": [8]})

    class Frozen(Wrapped):
        def forward(self, inputs):
            return self.inner(inputs) * inputs.num_tokens  # a Python count: frozen at capture

    manager = CaptureManager(Frozen(build_model(config)), config, progress=False)
    with pytest.raises(CaptureError, match=r"partly filled batch \(1 of 8 tokens") as caught:
        manager.capture()
    mismatch = caught.value.__cause__
    assert isinstance(mismatch, ReplayMismatchError) and mismatch.key.num_tokens == 8 and mismatch.what == "output"


def test_an_outcome_s_eager_reason_is_one_the_registry_counts():
    key = GraphKey(8, 8, True)
    outcome = KeyOutcome(key, "captured", 1.0, 64)
    assert outcome.skipped("no_speedup: slow", "no_speedup").counted_as == "no_speedup"
    assert outcome.skipped("no_speedup: a failure's words").counted_as == "skipped"  # the text decides nothing
    with pytest.raises(ValueError, match=r"eager_reason 'slow' is not a key of EAGER_REASONS"):
        outcome.skipped("slow", "slow")
