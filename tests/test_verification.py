"""Capture-time verification runs padded rows and catches host values frozen into a graph.

After the replay of the dummy batch, each key is verified on partly filled batches
(`graphcap.probe.probe_batch` at each `probe_fills` level): fewer real requests and tokens, other
ids, lengths and blocks.
A forward that reads a Python value from the step (frozen at capture) passes the first check
and fails this one, at capture instead of on the first real step.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import CaptureError, CaptureManager, GraphKey
from graphcap.capture import verification
from graphcap.capture import verifier as capture_module
from graphcap.capture.recorder import Recorder
from graphcap.capture.verifier import Verifier
from graphcap.models import build_model
from graphcap.probe import probe_batch
from graphcap.testing import Wrapped, make_config, make_manager
from graphcap.testing.fuzz import Limits


class FrozenCount(torch.nn.Module):
    """The reference model, scaled by a Python count: frozen at capture, live in eager runs."""

    def __init__(self, inner, read) -> None:
        super().__init__()
        self.inner, self.read = inner, read

    def forward(self, inputs):
        return self.inner(inputs) * self.read(inputs)


@pytest.mark.parametrize(
    "read",
    [
        lambda inputs: inputs.num_tokens,  # a Python count of the step
        lambda inputs: float(inputs.host.seq_lens[: inputs.num_reqs].max()),  # a host value
        lambda inputs: int(inputs.host.input_ids[0]) + 1,
    ],
    ids=["num_tokens", "host_seq_lens", "host_input_ids"],
)
def test_a_host_value_frozen_into_the_graph_fails_capture_not_the_first_step(read):
    config = make_config(capture__sizes=[4])
    model = FrozenCount(build_model(config), read)
    manager = make_manager(config)
    manager.model = model
    manager._forward = model.forward
    with pytest.raises(CaptureError, match=r"partly filled batch .* froze a host value at capture"):
        manager.capture()


def test_the_dummy_batch_alone_would_have_passed(monkeypatch):
    """Control: the same frozen count passes a verification that replays only the dummy batch."""
    config = make_config(capture__sizes=[4])
    model = FrozenCount(build_model(config), lambda inputs: inputs.num_tokens)
    manager = make_manager(config)
    manager.model, manager._forward = model, model.forward
    monkeypatch.setattr(Verifier, "fills", lambda self, key, graph: (0.0, ()))  # the dummy batch alone
    manager.capture()  # passes: the damage shows only on a real, partly filled step
    batch, _ = probe_batch(
        GraphKey(4, 4, False),
        max_model_len=32,
        block_size=4,
        num_blocks=72,
        vocab_size=128,
        scratch_blocks=range(1, 72),
    )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


@pytest.mark.parametrize("engine_context", [False, True], ids=["right_after_capture", "after_the_context"])
def test_a_value_that_changes_every_call_fails_the_dummy_batch_check(engine_context):
    """A Python value that changes on every call (here a call count) is frozen at capture: the dummy batch's
    replay differs from its eager run. Without an engine context each key is verified right after its capture,
    against its last warmup's output; with one, after the context, against a fresh eager run. Both catch it
    on the dummy batch, before the probe batch."""
    config = make_config(capture__sizes=[4])
    calls = []

    def count(inputs):
        calls.append(1)
        return float(len(calls))

    model = FrozenCount(build_model(config), count)
    manager = make_manager(config, capture_context=contextlib.nullcontext if engine_context else None)
    manager.model, manager._forward = model, model.forward
    with pytest.raises(CaptureError, match="replay differs from eager on the same inputs"):
        manager.capture()


def test_the_warmup_reference_is_the_same_check_as_a_fresh_eager_run(monkeypatch):
    """Control for the reference kept from the last warmup: a correct model verifies every key either way,
    and the replayed rows equal the fresh eager run's rows bit for bit (the CPU runs the same kernels)."""
    seen = []
    original = verification.compare_replay

    def recorded(graph, inputs, eager, **kwargs):
        seen.append((eager(), kwargs["message"]))
        return original(graph, inputs, eager, **kwargs)

    monkeypatch.setattr(capture_module, "compare_replay", recorded)
    manager = make_manager(make_config(capture__sizes=[4, 8]))
    report = manager.capture()
    assert report.records and all(r.verified and r.speedup > 0 for r in report.records)
    dummies = [expected for expected, message in seen if message is verification.DUMMY_MISMATCH]
    assert len(dummies) == len(report.records)
    job = Recorder(manager.capturer.parts)
    for record, expected in zip(report.records, dummies):
        inputs = job.stage_dummy(record.key)
        with torch.inference_mode():
            fresh = manager._outputs.real(job.reference_run(inputs, manager.registry.mode_of(record.key))(), inputs)
        torch.testing.assert_close(expected, fresh, rtol=0, atol=0)


def test_a_forward_that_slices_the_kv_write_by_a_python_count_fails_capture():
    config = make_config(capture__sizes=[8])
    inner = build_model(config)

    class SlicedWrite(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            out = self.inner(inputs)
            # Adds this step's logits to a running buffer for the first num_tokens rows only:
            # with the count frozen at capture, padded rows are added on a partly filled step.
            n = inputs.num_tokens
            return out + out[:n].sum(0, keepdim=True)

    manager = make_manager(config)
    manager.model = SlicedWrite()
    manager._forward = manager.model.forward
    with pytest.raises(CaptureError, match="partly filled"):
        manager.capture()


def test_a_correct_model_passes_both_verifications_for_every_key():
    manager = make_manager(make_config())
    report = manager.capture()
    assert report.records and all(r.verified for r in report.records)


@given(
    T=st.integers(1, 32),
    R=st.integers(1, 8),
    uniform=st.booleans(),
    seed=st.integers(0, 3),
)
@settings(max_examples=120, deadline=None)
def test_probe_batch_is_partly_filled_and_fits_its_key(T, R, uniform, seed):
    R = min(R, T)  # a key never has more request rows than tokens
    if uniform:
        T = T - T % R or R
    key = GraphKey(T, R, uniform)
    limits = Limits.of(make_config())
    scratch = list(range(limits.num_blocks // 2, limits.num_blocks))
    batch, writes = probe_batch(
        key,
        **limits.probe_sizes,
        seed=seed,
        scratch_blocks=scratch,
    )
    assert batch.num_tokens <= T and batch.num_reqs <= R
    if R > 1:
        assert batch.num_reqs < R  # padded requests exist
    if not uniform and T > 2:
        assert batch.num_tokens < T  # padded tokens exist (a key of 2: both tokens over one request)
    if not uniform and T > 3:
        assert batch.num_tokens > batch.num_reqs  # query lengths > 1: a per-request output cut per token shows
    if uniform:
        assert batch.is_uniform(T // R)
    assert batch.max_seq_len <= limits.max_model_len
    starts = batch.seq_lens - batch.query_lens
    # Every request reads its own blocks, never the null block; with enough scratch blocks every
    # computed token writes its own slot, and only in a scratch block.
    bs = limits.block_size
    for i in range(batch.num_reqs):
        assert np.all(batch.block_table[i, : -(-int(batch.seq_lens[i]) // bs)] >= 1)
    tokens = [(i, p) for i in range(batch.num_reqs) for p in range(int(starts[i]), int(batch.seq_lens[i]))]
    written = [int(batch.block_table[i, p // bs]) for i, p in tokens]
    slots = [block * bs + p % bs for block, (_, p) in zip(written, tokens)]
    assert writes == (sum(-(-int(s) // bs) - int(c) // bs for s, c in zip(batch.seq_lens, starts)) <= len(scratch))
    if writes:
        assert len(set(slots)) == len(slots) and set(written) <= set(scratch)
    assert np.all(batch.input_ids < limits.vocab_size)


def test_16_bit_outputs_are_compared_by_norm_relative_error_unless_tolerances_are_given():
    """A replay at the padded shape runs other GEMM kernels than the eager run at the real shape: for
    16-bit logits one element off by a few ulps must not fail a correct graph; a wrong one still fails."""
    from graphcap.capture.verification import difference

    torch.manual_seed(0)
    eager = torch.randn(64, 512).to(torch.bfloat16)
    near = eager.clone()
    near[3, 7] = near[3, 7] * 1.08  # one element 8% off: elementwise assert_close refuses it
    with pytest.raises(AssertionError):
        torch.testing.assert_close(near, eager)
    assert difference(near, eager, {}) is None
    assert difference((near, eager.float()), (eager, eager.float()), {}) is None  # mixed outputs
    wrong = eager.clone()
    wrong[:8] = 0  # a wrong graph: an eighth of the rows missing
    assert "norm-relative error" in difference(wrong, eager, {})
    nan = near.clone()
    nan[0, 0] = float("nan")
    assert "non-finite" in difference(nan, eager, {})
    assert difference(near, eager, {"atol": 1e-5, "rtol": 1e-5}) is not None  # explicit: elementwise


@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    n=st.integers(0, 6),
    noise=st.sampled_from([0.0, 1e-9, 1e-6, 1e-5, 1e-3, 3e-2, 1.0]),
    nan=st.booleans(),
    tolerance=st.sampled_from([{}, {"rtol": 1e-3, "atol": 1e-3}, {"rtol": 0.0, "atol": 0.0}]),
    reshaped=st.booleans(),
    seed=st.integers(0, 3),
)
@settings(max_examples=200, deadline=None)
def test_the_fast_comparison_never_accepts_what_assert_close_refuses(dtype, n, noise, nan, tolerance, reshaped, seed):
    """Verification decides with `torch.allclose` first and asks `torch.testing.assert_close` (which writes the
    message) only when that says no: the decision is assert_close's on every input."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    a = base.to(dtype) if dtype is not torch.bool else base > 0
    b = (base + noise * torch.randn(n, 3, generator=generator, dtype=torch.float64)).to(dtype)
    if dtype is torch.bool:
        b = (base + noise * torch.randn(n, 3, generator=generator, dtype=torch.float64)) > 0
    if nan and n and a.is_floating_point():
        a[0, 0] = b[0, 0] = float("nan")
    if reshaped and n:
        b = b.reshape(3, n)
    try:
        torch.testing.assert_close(a, b, **tolerance)
        passes = True
    except AssertionError:
        passes = False
    surely = verification._surely_close(a, b, tolerance)
    assert not surely or passes
    if a.is_floating_point() and a.shape == b.shape:
        assert surely == passes  # floats never need the slow path to pass
    if tolerance or dtype not in verification.NORM_TOLERANCE:  # 16-bit without tolerances: the norm check
        assert (verification.difference(a, b, tolerance) is None) == passes
        assert (verification.difference((a, a), (b, b), tolerance) is None) == passes


def test_float32_outputs_of_a_16_bit_model_are_judged_by_the_norm_relative_tolerance():
    # A model computing in bfloat16 and returning float32 logits: a replay at the padded shape and an
    # eager run at the real shape use other GEMM blockings, so a near-zero logit may differ by more
    # than float32's elementwise tolerance; a frozen-value bug (2x) is still refused.
    torch.manual_seed(0)
    expected = torch.randn(31, 4096)
    rounding = expected.clone()
    rounding[3, 7] += 1e-3  # one element off, far below bfloat16's resolution of the whole
    assert verification.difference(rounding, expected, {}) is not None  # elementwise (float32) refuses it
    assert verification.difference(rounding, expected, {}, torch.bfloat16) is None
    wrong = verification.difference(expected * 2, expected, {}, torch.bfloat16)
    assert wrong is not None and "computed in torch.bfloat16" in wrong
    # explicit checks.atol/rtol keep the elementwise comparison whatever the model's precision
    assert verification.difference(rounding, expected, {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16) is not None


def test_the_norm_relative_error_needs_non_finite_values_at_the_same_places():
    expected = torch.ones(3, 70000, dtype=torch.bfloat16)
    expected[2, 69999] = float("inf")
    assert verification.difference(expected.clone(), expected, {}) is None
    shifted = expected.clone()
    shifted[2, 69999], shifted[0, 0] = 1.0, float("inf")
    assert "non-finite" in verification.difference(shifted, expected, {})


def test_assert_close_gives_torch_testing_assert_closes_verdict_without_its_imports():
    a = torch.randn(4, 8)
    verification.assert_close(a, a.clone())
    verification.assert_close({"x": a, "y": (a > 0)}, {"x": a + 1e-7, "y": (a > 0)})
    verification.assert_close((a,), (a + 1e-3,), rtol=1e-2, atol=1e-2)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        verification.assert_close(a, a + 1)
    with pytest.raises(AssertionError, match="step 3"):
        verification.assert_close(a, a * 2, msg=lambda m: f"step 3: {m}")
    with pytest.raises(AssertionError, match="dtype"):
        verification.assert_close(a, a.double())
    with pytest.raises(AssertionError):
        verification.assert_close(torch.tensor([1, 2]), torch.tensor([1, 3]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=6),
    st.lists(st.floats(-1e-4, 1e-4), min_size=6, max_size=6),
)
def test_assert_close_agrees_with_torch_on_every_input(values, noise):
    a = torch.tensor(values, dtype=torch.float32)
    b = a + torch.tensor(noise[: len(values)], dtype=torch.float32)
    try:
        torch.testing.assert_close(b, a)
        torch_says = True
    except AssertionError:
        torch_says = False
    try:
        verification.assert_close(b, a)
        ours = True
    except AssertionError:
        ours = False
    assert ours == torch_says


class FirstRunDiffers(Wrapped):
    """The reference model plus one on the very first forward of the process's manager (a flag it then sets):
    a first run reads no state an earlier run left, as the replays after the recording do."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.register_buffer("ran", torch.zeros(()))
        self.calls = 0

    def forward(self, inputs):
        self.calls += 1
        out = self.inner(inputs) + (1 - self.ran)
        self.ran.fill_(1)
        return out


def _first_run_manager() -> CaptureManager:
    torch.set_num_threads(1)
    config = make_config({"capture.sizes": [2, 4]})
    return CaptureManager(FirstRunDiffers(build_model(config)), config, progress=False)


def test_a_dummy_batch_whose_reference_was_its_first_run_is_compared_again_after_the_replay():
    manager = _first_run_manager()
    report = manager.capture()
    assert report.records and all(r.status == "captured" and r.verified for r in report.records)
    # Only the first key's warmup was a first run that differs: one eager run more, in its verification. Keys
    # probed at the same counts probe the same batch, run eagerly once.
    probes = {fill for r in report.records for fill in r.verified_fills}
    assert manager.model.calls == 2 * len(report.records) + len(probes) + 1


def test_canary_a_first_run_taken_as_the_reference_fails_a_right_graph(monkeypatch):
    around = verification.LastRun.around

    def not_first(self, *args, **kwargs):
        run = around(self, *args, **kwargs)
        self.first = False  # as if an earlier run had preceded it
        return run

    monkeypatch.setattr(verification.LastRun, "around", not_first)
    with pytest.raises(CaptureError, match="replay differs from eager on the same inputs"):
        _first_run_manager().capture()
