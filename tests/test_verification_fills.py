"""Every key is verified on partly filled batches at several fill levels, and a model may read the real counts.

A model that breaks the padding contract shows only on some shares of padding: scaling by the
Python `inputs.num_tokens` is invisible on a batch that fills every token, and a capacity-limited
mixture-of-experts layer that lets padded tokens into routing is invisible when as many padded
tokens take capacity as the padded shape adds. Verification replays each key at one real token,
about half and all but one (`probe_fills`); a key that admits no smaller batch says so in its record.
`ForwardInputs.num_tokens_device` / `num_reqs_device` and `padding_mask()` are what a correct model
reads instead of the Python counts.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import CaptureError, CaptureManager, GraphKey, StepBatch
from graphcap.capture import references as probing
from graphcap.cli import main
from graphcap.models import build_model
from graphcap.probe import Fill, probe_batch, probe_fills
from graphcap.testing import make_config
from graphcap.testing.fuzz import Limits

SIZES = [1, 2, 3, 4, 8]


class ScaledByCount(torch.nn.Module):
    """The reference model scaled by the Python token count: frozen at capture, right on full batches only."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs):
        return self.inner(inputs) * inputs.num_tokens


class CapacityMoE(torch.nn.Module):
    """A mixture-of-experts layer over the reference model's logits, with capacity-limited experts.

    Each token picks its top expert (a router table by token id; every token prefers expert 0, and
    token 0, the pad token, most strongly); experts take tokens by router score, at most
    `capacity = max(1, tokens // 2)` each, and a dropped token keeps the layer's input. `masked`: the
    capacity counts real tokens (`num_tokens_device`) and padded tokens never route
    (`padding_mask()`). Not masked: the padded shape sets the capacity and padded tokens outrank
    real ones for it, so a replay keeps other real tokens than an eager run of the real batch.
    """

    def __init__(self, inner: torch.nn.Module, vocab_size: int, *, masked: bool, num_experts: int = 2) -> None:
        super().__init__()
        self.inner, self.masked = inner, masked
        generator = torch.Generator().manual_seed(0)
        router = torch.rand(vocab_size, num_experts, generator=generator)
        router[:, 0] += 1.0  # expert 0 is oversubscribed: capacity decides who it takes
        router[0] = torch.tensor([8.0] + [0.0] * (num_experts - 1))  # the pad token's score is the highest
        self.register_buffer("router", router)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(vocab_size, vocab_size) for _ in range(num_experts))

    def forward(self, inputs):
        h = self.inner(inputs)  # [T, V]
        probs = self.router[inputs.input_ids.long()].softmax(-1)  # [T, E]
        score, expert = probs.max(-1)  # [T]
        if self.masked:
            padded = inputs.padding_mask()
            score = score.masked_fill(padded, -1.0)  # padded tokens sort last
            capacity = torch.clamp(inputs.num_tokens_device // 2, min=1)
        else:
            padded = torch.zeros_like(score, dtype=torch.bool)
            capacity = max(1, h.shape[0] // 2)  # the padded shape
        order = torch.sort(score, descending=True, stable=True).indices  # [T]
        experts = torch.arange(len(self.experts), device=h.device)
        chosen = (expert[order, None] == experts).long()  # [T, E] one-hot, in score order
        place = (chosen.cumsum(0) - 1).gather(1, expert[order, None]).squeeze(1)  # place in its expert's queue
        kept_sorted = (place < capacity) & ~padded[order]
        kept = torch.zeros_like(kept_sorted).scatter(0, order, kept_sorted)  # [T], token order
        out = h
        for e, layer in enumerate(self.experts):
            out = out + layer(h) * (kept & (expert == e))[:, None]
        return out


def _manager(model_of, **overrides) -> CaptureManager:
    torch.set_num_threads(1)
    config = make_config({"capture.sizes": SIZES, **overrides})
    torch.manual_seed(0)
    model = model_of(build_model(config), config)
    return CaptureManager(model, config, progress=False)


def _admits_a_partial_batch(key: GraphKey) -> bool:
    return key.num_reqs > 1 if key.uniform else key.num_tokens > 1


# -- the fill levels ------------------------------------------------------------------------------


@given(T=st.integers(1, 64), R=st.integers(1, 16), uniform=st.booleans(), max_model_len=st.sampled_from([4, 32]))
@settings(max_examples=200, deadline=None)
def test_fills_are_partial_at_one_half_and_all_but_one_wherever_the_key_admits_it(T, R, uniform, max_model_len):
    R = min(R, T)
    if uniform:
        T = T - T % R
    if -(-T // max_model_len) > R or (uniform and max_model_len < T // R):
        return  # no batch of the key fits max_model_len
    key = GraphKey(T, R, uniform)
    fills = probe_fills(key, max_model_len=max_model_len)
    if not _admits_a_partial_batch(key):
        assert fills == (Fill(T, R),)
        return
    assert fills and all(not f.is_full(key) for f in fills) and len(set(fills)) == len(fills)
    for n, r in fills:
        assert 1 <= r <= min(n, R) and (n < T or (T == 2 and r < R)) and -(-n // max_model_len) <= r
        if R > 1:
            assert r < R or -(-n // max_model_len) == R  # fewer requests, unless max_model_len needs them all
    tokens = [n for n, _ in fills]
    assert tokens[0] == (T // R if uniform else 1)  # one request (one real token for a mixed key)
    last = (R - 1) * (T // R) if uniform else T - 1
    assert last in tokens  # all but one
    if not uniform and (T > 2 or R > 1) and -(-(T - 1) // max_model_len) < T - 1:
        assert any(n > r for n, r in fills)  # requests of several tokens: a per-request output cut per token shows


@given(T=st.integers(1, 32), R=st.integers(1, 8), uniform=st.booleans(), seed=st.integers(0, 3))
@settings(max_examples=100, deadline=None)
def test_each_probe_batch_has_its_fill_and_fits_the_key(T, R, uniform, seed):
    R = min(R, T)
    if uniform:
        T = T - T % R
    key = GraphKey(T, R, uniform)
    limits = Limits.of(make_config())
    for fill in probe_fills(key, max_model_len=limits.max_model_len):
        batch, _ = probe_batch(
            key,
            **limits.probe_sizes,
            seed=seed,
            fill=fill,
        )
        assert (batch.num_tokens, batch.num_reqs) == fill
        assert batch.max_seq_len <= limits.max_model_len
        if uniform:
            assert batch.is_uniform(T // R)


# -- a model that reads the Python count --------------------------------------------------------


def test_a_model_scaled_by_the_python_token_count_is_refused_at_every_key_that_admits_a_smaller_batch():
    manager = _manager(lambda inner, config: ScaledByCount(inner), **{"capture.on_error": "skip"})
    report = manager.capture()
    keys = {r.key: r for r in report.records}
    assert GraphKey(2, 2, False) in keys  # the key whose only partial batch is one token
    for key, record in keys.items():
        if _admits_a_partial_batch(key):
            assert record.status == "skipped" and not record.verified, key
            assert "partly filled batch" in record.reason
        else:  # one token or one request: every step it holds is full, so the count is right there
            assert record.verified and record.full_batch_only and record.verified_fills == ((key.num_tokens, 1),)
    batch = StepBatch([1], [3], input_ids=[5])
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))  # the full-only key is right


def test_a_model_scaled_by_the_python_count_passes_mixed_2_2_when_verified_on_full_batches(monkeypatch):
    """Canary: a probe that fills every token of mixed(2, 2) lets the count through, and a one-token step
    then replays twice the eager logits."""
    full = lambda key, *, max_model_len: (Fill(key.num_tokens, key.num_reqs),)  # noqa: E731
    monkeypatch.setattr(probing, "probe_fills", full)
    manager = _manager(lambda inner, config: ScaledByCount(inner), **{"capture.sizes": [2]})
    report = manager.capture()
    assert all(r.verified for r in report.records)
    batch = StepBatch([1], [3], input_ids=[5])
    torch.testing.assert_close(manager.execute(batch).clone(), 2 * manager.eager(batch))


# -- a capacity-limited mixture of experts --------------------------------------------------------


def test_a_moe_that_lets_padded_tokens_into_routing_is_refused_at_every_key_that_admits_a_smaller_batch():
    manager = _manager(
        lambda inner, config: CapacityMoE(inner, config.model.vocab_size, masked=False),
        **{"capture.on_error": "skip"},
    )
    report = manager.capture()
    for record in report.records:
        if _admits_a_partial_batch(record.key):
            assert record.status == "skipped" and not record.verified, record.key
        else:
            assert record.verified and record.full_batch_only, record.key


def test_one_fill_level_alone_lets_the_moe_through_at_some_keys(monkeypatch):
    """Canary for the several levels: verified at all but one token alone, the unmasked MoE passes keys
    (there the padded token takes the capacity slot the padded shape adds), and a one-token step on one of
    them differs from eager."""
    last = lambda key, *, max_model_len: probe_fills(key, max_model_len=max_model_len)[-1:]  # noqa: E731
    monkeypatch.setattr(probing, "probe_fills", last)
    manager = _manager(
        lambda inner, config: CapacityMoE(inner, config.model.vocab_size, masked=False),
        **{"capture.sizes": [4]},
    )
    report = manager.capture()
    assert all(r.verified for r in report.records)  # uniform(4, 4) and mixed(4, 4)
    batch = StepBatch([1], [4], input_ids=[7])
    assert manager.dispatch(batch) == GraphKey(4, 4, True)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


def test_a_moe_that_masks_padded_tokens_by_the_device_counts_passes_and_matches_eager_on_partial_batches():
    manager = _manager(lambda inner, config: CapacityMoE(inner, config.model.vocab_size, masked=True))
    report = manager.capture()
    assert all(r.verified for r in report.records)
    rng = np.random.default_rng(0)
    for n in range(1, 9):
        q = np.ones(n, dtype=np.int64)
        batch = StepBatch(q, q + rng.integers(0, 8, n), input_ids=rng.integers(0, 128, n))
        assert manager.dispatch(batch) is not None
        torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


def test_a_replay_reads_the_steps_counts_not_the_last_ones():
    """Poison: the packed counts are overwritten between steps; each replay reads what its step staged."""
    manager = _manager(
        lambda inner, config: CapacityMoE(inner, config.model.vocab_size, masked=True),
        **{"checks.poison_padding": True},
    )
    manager.capture()
    for q in ([1, 1, 1, 1, 1, 1, 1], [1], [2, 1], [1, 1, 1, 1, 1]):  # 7, 1, 3, 5 tokens: keys 8, 1, 4, 8
        batch = StepBatch(q, [3] * len(q), input_ids=list(range(1, sum(q) + 1)))
        key = manager.dispatch(batch)
        out = manager.execute(batch).clone()
        inputs = manager.buffers.plans.general_plans.get((key, batch.num_tokens, batch.num_reqs))
        staged = inputs.inputs if inputs is not None else manager.buffers.plans.decode_plans[(key, len(q))].inputs
        assert (int(staged.num_tokens_device), int(staged.num_reqs_device)) == (sum(q), len(q))
        torch.testing.assert_close(out, manager.eager(batch))
        manager.buffers.packed_host.fill(0x7F)  # whatever the next step does not stage stays absurd


# -- the command line ------------------------------------------------------------------------------

FACTORY = """
import torch
from dataclasses import replace
from graphcap.models import build_model

class ScaledByCount(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, inputs):
        return self.inner(inputs) * inputs.num_tokens

def make(config):
    return ScaledByCount(build_model(replace(config, model=replace(config.model, factory=None, name="tiny-llama"))))
"""


def test_capture_with_on_error_skip_marks_no_wrong_graph_verified(tmp_path, capsys):
    (tmp_path / "scaled_by_count.py").write_text(FACTORY)
    report = tmp_path / "report.json"
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(
            ["capture", "--config", "tiny-cpu-ci", "--set", "model.name=null", "--set",
             "model.factory=scaled_by_count:make", "--set", "capture.on_error=skip", "--set", "capture.sizes=[1, 2, 4]",
             "--set", "capture.max_size=4",
             "--report", str(report), "--no-progress"]
        )  # fmt: skip
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("scaled_by_count", None)
    out = capsys.readouterr().out
    graphs = json.loads(report.read_text())["graphs"]
    wrong = [g["key"] for g in graphs if g["verified"] and g["key"]["num_tokens"] > 1 and not g["key"]["uniform"]]
    assert wrong == [], (code, out)
    assert any(not g["verified"] and g["key"]["num_tokens"] == 2 and not g["key"]["uniform"] for g in graphs)
    assert "skipped" in out


# -- state carried between runs --------------------------------------------------------------------


class CarriedRows(torch.nn.Module):
    """Adds a running sum of every row it ever computed, padded rows included (`carry`, one row per token)."""

    def __init__(self, inner: torch.nn.Module, max_num_tokens: int, vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("carry", torch.zeros(max_num_tokens, vocab_size))

    def forward(self, inputs):
        h = self.inner(inputs)  # [T, V]
        rows = self.carry[: h.shape[0]]
        out = h + rows
        rows.add_(h)  # padded rows too: the next step's real rows read them
        return out


def test_a_model_whose_padded_rows_carry_state_is_refused_naming_the_state():
    manager = _manager(
        lambda inner, config: CarriedRows(inner, config.batching.max_num_tokens, config.model.vocab_size),
        **{"capture.sizes": [4]},
    )
    with pytest.raises(
        CaptureError,
        match=r"carries state between runs: two eager runs .* an eager run of it changed model.carry \(rows 0-",
    ) as caught:
        manager.capture()
    assert "kv_cache" not in str(caught.value)  # the KV cache's sink rows are no state


class OverwrittenRows(torch.nn.Module):
    """Adds the rows the last run computed, padded rows included, then overwrites them with its own."""

    def __init__(self, inner: torch.nn.Module, max_num_tokens: int, vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("last", torch.zeros(max_num_tokens, vocab_size))

    def forward(self, inputs):
        h = self.inner(inputs)  # [T, V]
        rows = self.last[: h.shape[0]]
        out = h + rows
        rows.copy_(h)
        return out


def test_state_an_earlier_run_left_is_named_as_state_not_as_a_frozen_value():
    manager = _manager(
        lambda inner, config: OverwrittenRows(inner, config.batching.max_num_tokens, config.model.vocab_size),
        **{"capture.sizes": [4]},
    )
    with pytest.raises(CaptureError, match="carries state between runs: two replays of the same batch") as caught:
        manager.capture()
    assert "froze a host value" not in str(caught.value) and "kv_cache" not in str(caught.value)


def test_a_frozen_python_count_keeps_its_own_message():
    """Control: the diagnosis names state only where a tensor changed; a frozen count is no state."""
    manager = _manager(lambda inner, config: ScaledByCount(inner), **{"capture.sizes": [4]})
    with pytest.raises(CaptureError, match="froze a host value at capture") as caught:
        manager.capture()
    assert "carries state" not in str(caught.value)


# -- engine buffers sampled by default -----------------------------------------------------------


class ReadsTemperature(torch.nn.Module):
    """The reference model divided by a per-request temperature (an engine buffer), each token by its request's.

    `frozen`: read from the host view as Python numbers, which a graph keeps from its capture."""

    def __init__(self, inner: torch.nn.Module, frozen: bool) -> None:
        super().__init__()
        self.inner, self.frozen = inner, frozen

    def forward(self, inputs):
        temperature = inputs.extras["temperature"]  # [R] float32
        if self.frozen:
            temperature = torch.tensor(inputs.host.extras["temperature"].tolist(), dtype=temperature.dtype)
        T = inputs.input_ids.shape[0]
        request = torch.searchsorted(inputs.query_start_loc[1:], torch.arange(T, dtype=torch.int32), right=True)
        request = request.clamp(max=temperature.shape[0] - 1)  # padded tokens: the last row (a sink)
        return self.inner(inputs) / temperature[request, None]


def _temperature_manager(frozen: bool, sample=None) -> CaptureManager:
    from graphcap import BufferSpec

    torch.set_num_threads(1)
    config = make_config({"capture.sizes": [4]})
    spec = BufferSpec("temperature", "reqs", dtype="float32", pad=1.0, sample=sample)
    return CaptureManager(ReadsTemperature(build_model(config), frozen), config, progress=False, buffers=[spec])


def test_a_float_buffer_read_as_a_host_value_is_refused_without_a_sample():
    with pytest.raises(CaptureError, match="froze a host value at capture"):
        _temperature_manager(frozen=True).capture()
    report = _temperature_manager(frozen=False).capture()  # read as a tensor: verified with sampled values
    assert all(r.verified for r in report.records)


def test_a_buffer_that_opts_out_of_sampling_holds_its_pad_and_lets_a_host_read_through():
    """Canary: `sample="pad"` verifies with the pad in every row, so the frozen read passes capture and a
    real step with other temperatures replays the capture's."""
    manager = _temperature_manager(frozen=True, sample="pad")
    assert all(r.verified for r in manager.capture().records)
    batch = StepBatch([1, 1], [3, 4], input_ids=[5, 6], extras={"temperature": np.array([0.5, 2.0])})
    with pytest.raises(AssertionError):
        torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


def test_default_samples_follow_the_dtype_and_integers_keep_their_pad():
    from graphcap import BufferSpec
    from graphcap.staging.extras import sampled

    specs = (
        BufferSpec("temperature", "reqs", dtype="float32", pad=1.0),
        BufferSpec("scale", "none", shape=(3,), dtype="float16", pad=0.0),
        BufferSpec("is_prefill", "reqs", dtype="bool", pad=False),
        BufferSpec("lora_index", "tokens", dtype="int32", pad=-1),  # may index engine state: not made up
        BufferSpec("top_p", "reqs", dtype="float32", pad=1.0, sample="pad"),
    )
    rows = sampled(specs, np.random.default_rng(0), 6, 64)
    assert sorted(rows) == ["is_prefill", "scale", "temperature"]
    assert rows["temperature"].shape == (64,) and 0.5 <= rows["temperature"].min() < rows["temperature"].max() <= 2
    assert rows["scale"].dtype == np.float16 and rows["scale"].shape == (3,) and np.isfinite(rows["scale"]).all()
    assert rows["is_prefill"].dtype == bool and rows["is_prefill"].any() and not rows["is_prefill"].all()
    with pytest.raises(ValueError, match=r"BufferSpec 'x': sample: must be callable\(rng, num_real_rows\), 'pad'"):
        BufferSpec("x", "reqs", dtype="float32", sample="always")


# -- the counts on the device ---------------------------------------------------------------------


@given(
    query_lens=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    extra_tokens=st.integers(0, 8),
    extra_reqs=st.integers(0, 4),
)
@settings(max_examples=80, deadline=None)
def test_the_device_counts_and_padding_masks_follow_every_staged_step(query_lens, extra_tokens, extra_reqs):
    from graphcap import PersistentBuffers

    buffers = PersistentBuffers(16, 48, 4, block_size=4, num_blocks=64, poison=True)
    buffers.stage(StepBatch([1] * 16, [2] * 16), GraphKey(48, 16, False))  # every row dirty before the step
    n, r = sum(query_lens), len(query_lens)
    key = GraphKey(n + extra_tokens, min(r + extra_reqs, 16), False)
    inputs = buffers.stage(StepBatch(query_lens, [q + 1 for q in query_lens]), key)
    assert (int(inputs.num_tokens_device), int(inputs.num_reqs_device)) == (n, r)
    assert inputs.padding_mask().tolist() == [t >= n for t in range(key.num_tokens)]
    assert inputs.padding_mask("reqs").tolist() == [i >= r for i in range(key.num_reqs)]
    with pytest.raises(ValueError, match=r"padding_mask\(rows=...\) takes 'tokens' or 'reqs'; got 'blocks'"):
        inputs.padding_mask("blocks")
