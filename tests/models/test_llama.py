"""TinyLlama: the paged forward equals a dense per-request reference, padding never writes a
live slot, a broken query_start_loc tail fails like production, and no capture-unsafe op runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcap.backends.base import CaptureUnsafeError
from graphcap.backends.preflight import unsafe_op_checker
from graphcap.batch import StepBatch, dummy_batch
from graphcap.config import load_config
from graphcap.keys import GraphKey
from graphcap.models import TinyLlama, build_model, dense_reference
from graphcap.staging import PersistentBuffers


def _config(**overrides):
    return load_config(overrides={"device": "cpu", **overrides})


@pytest.fixture(scope="module")
def setup():
    """The default tiny model with its buffers; tests reset the cache they dirty."""
    config = _config()
    return config, build_model(config), PersistentBuffers.from_config(config)


class _Request:
    def __init__(self, tokens: list[int], prompt_len: int, blocks: list[int]) -> None:
        self.tokens, self.prompt_len, self.blocks = tokens, prompt_len, blocks
        self.num_computed = 0


def _make_requests(config, prompt_lens, num_decode, rng) -> list[_Request]:
    """Random token sequences, each with blocks for its whole length; block 0 never used."""
    kv = config.kv_cache
    pool = list(rng.permutation(np.arange(1, kv.num_blocks)))  # shuffled: blocks are not contiguous
    out = []
    for n in prompt_lens:
        total = n + num_decode
        blocks = [int(pool.pop()) for _ in range(-(-total // kv.block_size))]
        tokens = rng.integers(0, config.model.vocab_size, size=total).tolist()
        out.append(_Request(tokens, n, blocks))
    return out


def _next_step(requests, config, rng, max_chunk):
    """Schedule some unfinished requests: prompt chunks of 1..max_chunk tokens, then decodes."""
    active = [r for r in requests if r.num_computed < len(r.tokens)]
    chosen = [r for r in active if rng.random() < 0.8] or active[:1]
    q = [
        min(int(rng.integers(1, max_chunk + 1)), r.prompt_len - r.num_computed) if r.num_computed < r.prompt_len else 1
        for r in chosen
    ]
    width = max(len(r.blocks) for r in chosen)
    table = np.zeros((len(chosen), width), dtype=np.int32)
    for i, r in enumerate(chosen):
        table[i, : len(r.blocks)] = r.blocks
    ids = [t for r, n in zip(chosen, q) for t in r.tokens[r.num_computed : r.num_computed + n]]
    seq = [r.num_computed + n for r, n in zip(chosen, q)]
    batch = StepBatch(q, seq, ids, table)
    # Padded key: more tokens and more requests than real, so the sink and pad rows exist.
    T = min(batch.num_tokens + int(rng.integers(1, 9)), config.batching.max_num_tokens)
    R = min(batch.num_reqs + int(rng.integers(1, 4)), config.batching.max_num_seqs)
    return chosen, q, batch, GraphKey(T, R, False)


def _run_and_compare(config, model, buffers, seed, prompt_lens, num_decode=5, max_chunk=16):
    rng = np.random.default_rng(seed)
    model.reset_kv_cache()
    requests = _make_requests(config, prompt_lens, num_decode, rng)
    expected = dense_reference(model, [r.tokens for r in requests])
    num_steps = 0
    while any(r.num_computed < len(r.tokens) for r in requests):
        chosen, q, batch, key = _next_step(requests, config, rng, max_chunk)
        inputs = buffers.stage(batch, key)
        logits = model(inputs)
        assert logits.shape == (key.num_tokens, config.model.vocab_size)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all(), "padded rows must stay finite too"
        start = 0
        for r, n in zip(chosen, q):
            want = expected[requests.index(r)][r.num_computed : r.num_computed + n]
            torch.testing.assert_close(
                logits[start : start + n], want, msg=lambda m, r=r, n=n: f"request at {r.num_computed}+{n}: {m}"
            )
            start += n
            r.num_computed += n
        num_steps += 1
    return num_steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_forward_matches_dense_reference_with_chunked_prefill_and_decode(setup, seed):
    config, model, buffers = setup
    # Lengths around the block size (16): prefills and decodes cross block boundaries.
    steps = _run_and_compare(config, model, buffers, seed, [1, 15, 16, 17, 40, 33], num_decode=6)
    assert steps >= 7


def test_paged_forward_matches_dense_reference_with_small_blocks():
    config = _config(**{"kv_cache.block_size": 4, "batching.max_num_seqs": 8})
    model = build_model(config)
    _run_and_compare(config, model, PersistentBuffers.from_config(config), 3, [3, 9, 22], num_decode=7, max_chunk=6)


def test_decode_at_max_model_len_uses_every_block_column():
    config = _config(**{"kv_cache.max_model_len": 64, "kv_cache.num_blocks": 8})
    model = build_model(config)
    _run_and_compare(config, model, PersistentBuffers.from_config(config), 4, [60], num_decode=4, max_chunk=32)


def _slot_view(model: TinyLlama) -> torch.Tensor:
    c = model.kv_cache  # [layers, 2, KV, NB+1, bs, D] -> slots on dim 3
    return c.view(*c.shape[:3], -1, c.shape[-1])


def test_padded_tokens_write_only_the_scratch_slot(setup):
    _, model, buffers = setup
    model.reset_kv_cache()
    # A few live blocks with known content, so an overwrite of any of them is visible.
    bt = np.array([[3, 7, 0], [5, 0, 0]], dtype=np.int32)
    model(buffers.stage(StepBatch([20, 9], [20, 9], list(range(29)), bt), GraphKey(32, 4, False)))
    _slot_view(model)[:, :, :, model.scratch_slot] = 7.0  # so the PAD write is visible there
    before = _slot_view(model).clone()
    batch = StepBatch([1, 1], [21, 10], [5, 6], bt)
    inputs = buffers.stage(batch, GraphKey(8, 4, False))  # 6 PAD tokens, 2 padded requests
    model(inputs)
    changed = (_slot_view(model) != before).flatten(0, 2).any(0).any(-1)  # changed: [slots]
    written = set(inputs.host.slot_mapping[: batch.num_tokens].tolist())
    assert written == {7 * 16 + 4, 5 * 16 + 9}
    assert set(torch.nonzero(changed).flatten().tolist()) == written | {model.scratch_slot}


def test_reset_kv_cache_zeroes_in_place(setup):
    _, model, buffers = setup
    model(buffers.stage(StepBatch([4], [4], [1, 2, 3, 4], [[2]]), GraphKey(4, 1, False)))
    ptr = model.kv_cache.data_ptr()
    assert model.kv_cache.abs().sum() > 0
    model.reset_kv_cache()
    assert model.kv_cache.data_ptr() == ptr
    assert not model.kv_cache.any()


def test_kv_cache_is_sized_from_config_with_one_scratch_block(setup):
    config, model, _ = setup
    m, kv = config.model, config.kv_cache
    shape = (m.num_layers, 2, m.num_kv_heads, kv.num_blocks + 1, kv.block_size, m.head_dim)
    assert model.kv_cache.shape == shape
    assert "kv_cache" not in model.state_dict()  # non-persistent: not a weight


def test_broken_query_start_loc_tail_fails_like_production(setup):
    _, model, buffers = setup
    batch = StepBatch([3], [3], [1, 2, 3], [[1]])
    inputs = buffers.stage(batch, GraphKey(8, 4, False))
    assert inputs.host.query_start_loc.tolist() == [0, 3, 3, 3, 3]
    inputs.host.query_start_loc[batch.num_reqs + 1 :] = 0  # the dummy-run bug: [0, 3, 0, 0, 0]
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        model(inputs)


def test_dummy_batches_run_on_the_null_block_and_stay_finite(setup):
    config, model, buffers = setup
    for key in (GraphKey(1, 1, True), GraphKey(16, 16, True), GraphKey(64, 8, False)):
        inputs = buffers.stage(dummy_batch(key, max_model_len=config.kv_cache.max_model_len), key)
        assert torch.isfinite(model(inputs)).all()
    model.reset_kv_cache()


_UNSAFE_CASES = {
    "uniform-decode": (
        StepBatch([1] * 5, [4, 7, 1, 2, 17], [9] * 5, [[1, 0], [2, 0], [3, 0], [4, 0], [5, 6]]),
        GraphKey(8, 8, True),
    ),
    "mixed-prefill": (StepBatch([5, 3], [9, 3], list(range(8)), [[1], [2]]), GraphKey(24, 4, False)),
}


@pytest.mark.parametrize("case", list(_UNSAFE_CASES))
def test_forward_has_no_capture_unsafe_op(setup, case):
    _, model, buffers = setup
    inputs = buffers.stage(*_UNSAFE_CASES[case])
    with torch.inference_mode(), unsafe_op_checker("cpu"):
        with pytest.raises(CaptureUnsafeError):  # the checker is live
            torch.repeat_interleave(torch.tensor([1, 2]))
        model(inputs)
    model.reset_kv_cache()


def test_same_seed_gives_same_weights_and_different_seed_differs():
    a, b = build_model(_config()), build_model(_config())
    c = build_model(_config(**{"model.seed": 1}))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        assert not pa.requires_grad


def test_bfloat16_builds_and_runs_on_cpu():
    config = _config(**{"model.dtype": "bfloat16"})
    model = build_model(config)
    assert model.embed.dtype == torch.bfloat16 and model.kv_cache.dtype == torch.bfloat16
    buffers = PersistentBuffers.from_config(config)
    logits = model(buffers.stage(StepBatch([5, 1], [5, 9], list(range(6)), [[1], [2]]), GraphKey(8, 4, False)))
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
