"""`graphcap.keys`: the key registry plans keys from the config and maps each step to one key and mode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.batch import StepBatch, dummy_batch
from graphcap.config import load_config
from graphcap.errors import BatchError
from graphcap.keys import EAGER_REASONS, Dispatch, GraphKey, KeyRegistry, Mode, mixed_request_rows
from graphcap.sizing.sizes import CaptureSizes
from graphcap.testing import make_config, make_manager

SIZES = CaptureSizes([1, 2, 4, 8, 16, 32], 64)


def pair(dispatch: Dispatch) -> tuple[GraphKey | None, str]:
    """`(key, "")` for a graph, `(None, reason)` for an eager step."""
    assert (dispatch.mode is Mode.EAGER) == bool(dispatch.reason)
    return (None, dispatch.reason) if dispatch.mode is Mode.EAGER else (dispatch.key, "")


def key_for(keys: KeyRegistry, batch: StepBatch) -> tuple[GraphKey | None, str]:
    return pair(keys.dispatch(batch.num_tokens, batch.num_reqs, batch.is_uniform(keys.uniform_query_len)))


def registry(mode="full", q=1, max_num_seqs=8, sizes=SIZES, capture_all=True) -> KeyRegistry:
    keys = KeyRegistry(sizes, mode, q, max_num_seqs)
    if capture_all:
        for key in keys.planned:
            keys.mark_captured(key)
    return keys


def decode(num_reqs: int, q: int = 1) -> StepBatch:
    return StepBatch([q] * num_reqs, [q + 5] * num_reqs)


def test_mode_full_plans_a_mixed_key_per_size_and_uniform_keys_that_fit():
    keys = registry(capture_all=False)
    assert [k for k in keys.planned if not k.uniform] == [
        GraphKey(1, 1, False), GraphKey(2, 2, False), GraphKey(4, 4, False),
        GraphKey(8, 8, False), GraphKey(16, 8, False), GraphKey(32, 8, False),
    ]  # fmt: skip
    # uniform decode keys only while size / q requests fit max_num_seqs
    assert [k for k in keys.planned if k.uniform] == [GraphKey(s, s, True) for s in (1, 2, 4, 8)]
    assert len(keys) == 10 and set(keys) == set(keys.planned)


def test_mode_full_with_uniform_query_len_4_plans_uniform_keys_at_multiples_of_4():
    keys = registry(q=4, capture_all=False)
    assert [k for k in keys.planned if k.uniform] == [
        GraphKey(4, 1, True),
        GraphKey(8, 2, True),
        GraphKey(16, 4, True),
        GraphKey(32, 8, True),
    ]
    assert sum(not k.uniform for k in keys.planned) == 6


def test_mode_full_decode_only_plans_uniform_keys_only():
    keys = registry(mode="full_decode_only", q=4, capture_all=False)
    assert keys.planned == (GraphKey(4, 1, True), GraphKey(8, 2, True), GraphKey(16, 4, True), GraphKey(32, 8, True))


def test_mode_none_plans_nothing():
    assert registry(mode="none", capture_all=False).planned == ()


def test_capture_order_is_largest_first_uniform_before_mixed():
    order = registry(capture_all=False).capture_order()
    assert [k.num_tokens for k in order] == sorted((k.num_tokens for k in order), reverse=True)
    assert order[:4] == [GraphKey(32, 8, False), GraphKey(16, 8, False), GraphKey(8, 8, True), GraphKey(8, 8, False)]


def test_from_config_plans_the_default_schedule():
    keys = KeyRegistry.from_config(load_config())
    assert {k.num_tokens for k in keys.planned} == set(load_config().capture_sizes.sizes)
    assert all(k.num_reqs <= 32 for k in keys.planned)
    assert KeyRegistry.from_config(load_config(overrides={"capture.mode": "none"})).planned == ()


def test_uniform_batch_dispatches_to_the_uniform_key():
    assert key_for(registry(), decode(3)) == (GraphKey(4, 4, True), "")
    assert key_for(registry(q=4), decode(3, q=4)) == (GraphKey(16, 4, True), "")


def test_mixed_batch_dispatches_to_the_mixed_key():
    assert key_for(registry(), StepBatch([2, 1], [5, 5])) == (GraphKey(4, 4, False), "")


def test_uniform_batch_at_a_size_without_a_uniform_key_uses_the_mixed_key():
    keys = registry(q=2, sizes=CaptureSizes([3, 6, 12], 64))
    assert key_for(keys, decode(1, q=2)) == (GraphKey(3, 3, False), "")  # 3 is not a multiple of 2
    assert key_for(keys, decode(3, q=2)) == (GraphKey(6, 3, True), "")
    # 16 decode requests would need 16 rows; max_num_seqs 8 leaves no uniform key at 16
    assert key_for(registry(max_num_seqs=8), StepBatch([2] * 8, [9] * 8)) == (GraphKey(16, 8, False), "")


def test_skipped_uniform_key_falls_back_to_the_mixed_key():
    keys = registry()
    keys.mark_skipped(GraphKey(4, 4, True), "out of memory")
    assert key_for(keys, decode(3)) == (GraphKey(4, 4, False), "")
    assert keys.skipped == {GraphKey(4, 4, True): "out of memory"}


@pytest.mark.parametrize(
    ("keys", "batch", "reason"),
    [
        (registry(), StepBatch([33], [33]), "above_max_size"),
        (registry(), decode(40), "above_max_size"),
        (registry(mode="none"), decode(1), "mode_none"),
        (registry(mode="full_decode_only"), StepBatch([2, 1], [2, 1]), "decode_only"),
        (registry(capture_all=False), decode(2), "not_captured"),
        (registry(capture_all=False), StepBatch([2, 1], [2, 1]), "not_captured"),
        (registry(mode="full_decode_only", capture_all=False), decode(2), "not_captured"),
    ],
)
def test_dispatch_runs_eagerly_with_the_reason(keys, batch, reason):
    assert key_for(keys, batch) == (None, reason)
    assert reason in EAGER_REASONS


def test_more_requests_than_max_num_seqs_is_refused_by_dispatch_as_by_staging():
    with pytest.raises(BatchError, match=r"batch has 3 requests, above batching.max_num_seqs 2; the scheduler must"):
        key_for(registry(max_num_seqs=2), StepBatch([1, 1, 2], [1, 1, 2]))


def test_a_manager_refuses_such_a_step_and_counts_no_eager_reason_for_it():
    manager = make_manager(make_config(batching__max_num_seqs=2))
    manager.capture()
    for step in (manager.execute, manager.eager, manager.dispatch):
        with pytest.raises(BatchError, match=r"batch has 3 requests, above batching.max_num_seqs 2"):
            step(StepBatch([1, 1, 2], [1, 1, 2]))
    assert not manager.stats.eager


def test_skipped_key_runs_eagerly_with_reason_skipped():
    keys = registry()
    keys.mark_skipped(GraphKey(4, 4, False), "capture failed")
    assert key_for(keys, StepBatch([2, 1], [2, 1])) == (None, "skipped")
    keys = registry(mode="full_decode_only")
    keys.mark_skipped(GraphKey(2, 2, True), "capture failed")
    assert key_for(keys, decode(2)) == (None, "skipped")


def test_mark_captured_after_skip_clears_the_skip_and_reset_forgets_everything():
    keys = registry(capture_all=False)
    key = GraphKey(4, 4, False)
    keys.mark_skipped(key, "boom")
    keys.mark_captured(key)
    assert key in keys.captured and key not in keys.skipped
    keys.reset()
    assert not keys.captured and not keys.skipped and len(keys.planned) == 10


def test_keys_made_at_call_sites_are_refused():
    with pytest.raises(
        ValueError, match=r"mixed\(tokens=3, reqs=3\) is not a planned key; keys come from the registry"
    ):
        registry().mark_captured(GraphKey(3, 3, False))
    with pytest.raises(ValueError, match=r"not a planned key"):
        registry().mark_skipped(GraphKey(64, 8, False), "x")


@st.composite
def _batches(draw, max_tokens=40, max_reqs=8):
    if draw(st.booleans()):  # uniform
        q = draw(st.sampled_from([1, 2, 4]))
        num_reqs = draw(st.integers(0, min(max_reqs, max_tokens // q)))
        return StepBatch([q] * num_reqs, [q + 3] * num_reqs)
    query_lens = draw(st.lists(st.integers(1, 12), max_size=max_reqs))
    return StepBatch(query_lens, query_lens)


@given(batch=_batches(), mode=st.sampled_from(["full", "full_decode_only"]), q=st.sampled_from([1, 2, 4]))
@settings(max_examples=300, deadline=None)
def test_dispatched_key_holds_the_batch_at_the_smallest_captured_size(batch, mode, q):
    keys = registry(mode=mode, q=q, max_num_seqs=8)
    key, reason = key_for(keys, batch)
    if batch.num_tokens > SIZES.max_size:
        assert (key, reason) == (None, "above_max_size")
        return
    if key is None:
        # Only a mixed batch under decode-only, or a uniform size with no key that fits, runs eagerly.
        assert mode == "full_decode_only" and reason in ("decode_only", "not_captured"), reason
        return
    assert reason == ""
    assert key in keys.captured
    assert batch.num_tokens <= key.num_tokens and batch.num_reqs <= key.num_reqs
    assert key.num_tokens == min(s for s in SIZES.sizes if s >= batch.num_tokens)
    assert not key.uniform or batch.is_uniform(q)
    if mode == "full":
        uniform_planned = GraphKey(key.num_tokens, key.num_tokens // q, True) in keys.planned
        assert key.uniform == (uniform_planned and batch.is_uniform(q))


# -- from vLLM's and SGLang's dispatch cases -------------------------------------------------


def test_full_decode_only_captures_the_uniform_key_at_max_num_seqs():
    """max_num_seqs 20 is not a captured size: SGLang still captures the largest batch the pool allows."""
    config = load_config(overrides={"batching.max_num_seqs": 20, "capture.mode": "full_decode_only", "device": "cpu"})
    keys = registry(mode="full_decode_only", max_num_seqs=20, sizes=config.capture_sizes, capture_all=True)
    assert GraphKey(20, 20, True) in keys.planned
    for num_reqs in range(17, 21):
        assert key_for(keys, decode(num_reqs)) == (GraphKey(20, 20, True), ""), num_reqs
    assert key_for(keys, decode(16)) == (GraphKey(16, 16, True), "")
    assert key_for(keys, StepBatch([2, 1], [5, 5])) == (None, "decode_only")  # mixed: the reason is true


def test_a_uniform_key_is_never_padded_further_than_the_schedule():
    keys = registry(q=2, sizes=CaptureSizes([3, 6, 12], 64))  # uniform keys at 6 and 12, mixed at 3
    assert key_for(keys, decode(1, q=2)) == (GraphKey(3, 3, False), "")  # 2 tokens: 3 beats uniform 6


@given(
    max_num_seqs=st.integers(1, 40), q=st.sampled_from([1, 2, 4]), mode=st.sampled_from(["full", "full_decode_only"])
)
@settings(max_examples=60, deadline=None)
def test_every_decode_step_within_the_max_size_replays_a_graph(max_num_seqs, q, mode):
    config = load_config(
        overrides={
            "device": "cpu",
            "batching.max_num_seqs": max_num_seqs,
            "batching.max_num_tokens": 256,
            "capture.mode": mode,
            "capture.uniform_query_len": q,
            "capture.max_size": 64,
            "kv_cache.max_model_len": 64,
        }
    )
    keys = registry(mode=mode, q=q, max_num_seqs=max_num_seqs, sizes=config.capture_sizes)
    for num_reqs in range(1, max_num_seqs + 1):
        key, reason = key_for(keys, decode(num_reqs, q=q))
        if num_reqs * q <= 64:
            assert key is not None and key.uniform and key.num_reqs >= num_reqs, (num_reqs, reason)
        else:
            assert (key, reason) == (None, "above_max_size")


# -- request rows of mixed keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "max_num_seqs", "max_model_len", "rows"),
    [
        (2304, 1024, 2048, (64, 256, 1024)),  # a 256-request step no longer pads to 1024 rows
        (512, 256, 2048, (64, 256)),
        (300, 1024, None, (72, 300)),  # rounded down to a multiple of 8
        (232, 1024, None, (232,)),  # a quarter would be below 64 rows
        (64, 32, 512, (32,)),
        (4096, 1024, 32, (256, 1024)),  # 4096 tokens need at least 128 requests of 32
    ],
)
def test_mixed_request_rows_step_down_by_four_to_64_and_never_below_what_the_tokens_need(
    size, max_num_seqs, max_model_len, rows
):
    assert mixed_request_rows(size, max_num_seqs, max_model_len) == rows


def test_a_mixed_step_replays_the_key_of_its_size_with_the_fewest_rows_that_hold_it():
    keys = KeyRegistry(CaptureSizes([64, 512], 512), "full", 1, 1024, 2048)
    assert [k for k in keys.planned if not k.uniform and k.num_tokens == 512] == [
        GraphKey(512, 512, False),
        GraphKey(512, 128, False),
    ]
    for key in keys.planned:
        keys.mark_captured(key)
    assert pair(keys.dispatch(300, 100, False)) == (GraphKey(512, 128, False), "")
    assert pair(keys.dispatch(300, 128, False)) == (GraphKey(512, 128, False), "")
    assert pair(keys.dispatch(300, 129, False)) == (GraphKey(512, 512, False), "")
    keys.mark_skipped(GraphKey(512, 128, False), "x")  # fewer rows failed to capture: more rows replay
    assert pair(keys.dispatch(300, 100, False)) == (GraphKey(512, 512, False), "")
    keys.mark_skipped(GraphKey(512, 512, False), "x")
    assert pair(keys.dispatch(300, 100, False)) == (None, "skipped")


def test_capture_order_takes_more_rows_first_within_a_size():
    keys = KeyRegistry(CaptureSizes([64, 512], 512), "full", 1, 1024, 2048)
    order = keys.capture_order()
    assert order[:3] == [GraphKey(512, 512, True), GraphKey(512, 512, False), GraphKey(512, 128, False)]


def test_from_config_gives_mixed_keys_rows_that_max_model_len_can_fill():
    config = load_config(
        overrides={
            "batching.max_num_seqs": 1024,
            "batching.max_num_tokens": 4096,
            "capture.max_size": 4096,
            "kv_cache.max_model_len": 32,
            "kv_cache.num_blocks": 4096,
        }
    )
    keys = KeyRegistry.from_config(config)
    assert {k.num_reqs for k in keys.planned if k.num_tokens == 4096 and not k.uniform} == {256, 1024}
    for key in keys.planned:  # every planned key has a dummy batch (capture stages one)
        dummy_batch(key, max_model_len=32)


def test_graph_key_is_immutable_hashable_and_readable():
    key = GraphKey(64, 32, False)
    assert key == GraphKey(num_tokens=64, num_reqs=32, uniform=False) and hash(key) == hash((64, 32, False, ()))
    assert str(key) == "mixed(tokens=64, reqs=32)" and str(GraphKey(8, 8, True)) == "uniform(tokens=8, reqs=8)"
    assert str(GraphKey(8, None, False)) == "piecewise(tokens=8)" and GraphKey(8, None, False).piecewise
    with pytest.raises(AttributeError):
        key.num_tokens = 8


def test_the_mode_comes_beside_the_key_and_a_piecewise_key_is_one_form():
    """A piecewise graph of 8 tokens is GraphKey(8, None, False) in the registry, at dispatch, in staging
    and in stats; its capture batches' counts come from the registry, not from the key."""
    keys = registry(mode="full_and_piecewise")
    piece = GraphKey(8, None, False)
    assert piece in keys.planned and keys.mode_of(piece) is Mode.PIECEWISE
    assert keys.mode_of(GraphKey(8, 8, True)) is Mode.FULL
    assert keys.dispatch(7, 3, False) == Dispatch(Mode.PIECEWISE, piece, "")
    assert keys.dispatch(8, 8, True) == Dispatch(Mode.FULL, GraphKey(8, 8, True), "")
    assert keys.dispatch(40, 3, False) == Dispatch(Mode.EAGER, GraphKey(40, 3, False), "above_max_size")
    assert keys.capture_shape(piece) == GraphKey(8, 8, False)
    assert keys.capture_shape(GraphKey(8, 8, True)) == GraphKey(8, 8, True)
