"""Cumulative engine buffers (`BufferSpec` rows `reqs+1`): FlashInfer's `paged_kv_indptr`, flash-attention's
`cu_seqlens_k`. `[R+1]` offsets, the founding bug's shape: staged with `query_start_loc`'s tail rule (the last
real entry, or `pad` more per padded request) and checked by its invariants at `basic`, naming the buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import BatchError, BufferSpec, CaptureError, CaptureManager, GraphKey, InvariantViolation, StepBatch
from graphcap.checks.invariants import check_invariants
from graphcap.config import ConfigError, config_from_text
from graphcap.staging import PersistentBuffers
from graphcap.testing import make_config
from tests.conftest import (
    BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_MODEL_LEN,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    VOCAB,
    batches_and_keys,
)

INDPTR = BufferSpec("paged_kv_indptr", "reqs+1")  # pad "last" (0): padded requests own no page
CU_K = BufferSpec("cu_seqlens_k", "reqs+1", dtype="int64", pad=2)  # each padded request: 2 more keys


# The checks here run with dummy=True: the batches name no block table, and the null-block rule is not the subject.
def _buffers(*specs: BufferSpec) -> PersistentBuffers:
    return PersistentBuffers(
        MAX_REQS, MAX_TOKENS, MAX_BLOCKS, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, vocab_size=VOCAB,
        max_model_len=MAX_MODEL_LEN, extras=specs or (INDPTR, CU_K),
    )  # fmt: skip


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def test_a_cumulative_buffer_holds_the_real_entries_then_its_tail_rule():
    inputs = _buffers().stage(
        StepBatch([2, 1], [3, 4], extras={"paged_kv_indptr": [0, 1, 2], "cu_seqlens_k": [0, 3, 7]}),
        GraphKey(8, 5, False),
    )
    assert inputs.extras["paged_kv_indptr"].tolist() == [0, 1, 2, 2, 2, 2]  # [R+1]: the last real entry
    assert inputs.extras["cu_seqlens_k"].tolist() == [0, 3, 7, 9, 11, 13]  # 2 more per padded request
    assert inputs.extras["cu_seqlens_k"].dtype == torch.int64
    check_invariants(inputs, "full", dummy=True)


def test_a_step_without_the_buffer_stages_zero_for_every_request():
    inputs = _buffers().stage(StepBatch([1, 1], [2, 2]), GraphKey(4, 4, False))
    assert inputs.extras["paged_kv_indptr"].tolist() == [0] * 5
    assert inputs.extras["cu_seqlens_k"].tolist() == [0, 2, 4, 6, 8]
    check_invariants(inputs, "basic", dummy=True)


def test_a_cumulative_buffer_of_the_wrong_length_is_refused_before_any_write():
    buffers = _buffers()
    buffers.stage(StepBatch([1], [1]), GraphKey(2, 2, False))
    before = buffers.packed_host.copy()
    with pytest.raises(
        BatchError, match=r"extras\['paged_kv_indptr'\] has shape \(2,\); expected \(3,\) \(reqs\+1 rows = 3"
    ):
        buffers.stage(StepBatch([1, 1], [2, 2], extras={"paged_kv_indptr": [0, 1]}), GraphKey(2, 2, False))
    assert buffers.packed_host.tobytes() == before.tobytes()


@pytest.mark.parametrize(
    ("entries", "index", "expected", "actual", "why"),
    [
        ([1, 2, 3], 0, 0, 1, "cumulative offsets start at 0"),
        ([0, 5, 3], 2, ">= 5", 3, "cumulative offsets never decrease"),
    ],
)
def test_real_entries_that_break_the_offsets_rules_are_named_at_basic(entries, index, expected, actual, why):
    inputs = _buffers(INDPTR).stage(
        StepBatch([1, 1], [2, 2], extras={"paged_kv_indptr": entries}), GraphKey(4, 4, False)
    )
    with pytest.raises(InvariantViolation, match=why) as info:
        check_invariants(inputs, "basic", dummy=True)
    error = info.value
    assert (error.field, error.index, error.expected, error.actual) == ("paged_kv_indptr", index, expected, actual)
    assert f"paged_kv_indptr[{index}] is {actual}" in str(error) and "mixed(tokens=4, reqs=4)" in str(error)


def test_a_stale_tail_is_the_founding_bug_named_by_the_buffer():
    inputs = _buffers(INDPTR).stage(StepBatch([3], [3], extras={"paged_kv_indptr": [0, 1]}), GraphKey(8, 4, False))
    inputs.host.extras["paged_kv_indptr"][2:] = 0  # a dummy run that forgot the tail: offsets drop to 0
    with pytest.raises(InvariantViolation, match=r"paged_kv_indptr\[2\] is 0, expected 1: each padded entry repeats"):
        check_invariants(inputs, "basic", dummy=True)


any_batch_and_key = batches_and_keys() | batches_and_keys(uniform_query_len=1)
_SHARED = _buffers()


@st.composite
def _cumulative_steps(draw):
    batch, key = draw(any_batch_and_key)
    pages = draw(st.lists(st.integers(0, 6), min_size=batch.num_reqs, max_size=batch.num_reqs))
    keys = draw(st.lists(st.integers(0, 40), min_size=batch.num_reqs, max_size=batch.num_reqs))
    extras = {"paged_kv_indptr": _offsets(pages), "cu_seqlens_k": _offsets(keys)}
    q, seq = batch.query_lens, batch.seq_lens
    return StepBatch(q, seq, batch.input_ids, batch.block_table, extras=extras), key


@given(case=_cumulative_steps(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_any_valid_batch_stages_cumulative_buffers_passing_every_invariant_and_every_corrupted_tail_is_caught(
    case, data
):
    batch, key = case
    _SHARED.forget_padding()
    inputs = _SHARED.stage(batch, key)
    check_invariants(inputs, "full", dummy=True)
    for spec in (INDPTR, CU_K):
        view, given_ = inputs.host.extras[spec.name], batch.extras[spec.name]
        r = batch.num_reqs
        assert view[: r + 1].tolist() == given_.tolist()
        step = 0 if spec is INDPTR else 2
        assert view[r + 1 :].tolist() == [int(given_[-1]) + step * i for i in range(1, len(view) - r)]
    name = data.draw(st.sampled_from([INDPTR.name, CU_K.name]), "buffer")
    view = inputs.host.extras[name]
    if batch.num_reqs + 1 >= len(view):
        return  # no padded entry at this key
    index = data.draw(st.integers(batch.num_reqs + 1, len(view) - 1), "index")
    was = int(view[index])
    value = data.draw(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != was), "value")
    view[index] = value
    with pytest.raises(InvariantViolation) as info:
        check_invariants(inputs, "basic", dummy=True)
    assert (info.value.field, info.value.index, info.value.expected, info.value.actual) == (name, index, was, value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "float32"}, r"dtype: a reqs\+1 buffer is cumulative .*: an integer dtype; got float32"),
        ({"shape": (2,)}, r"shape: a reqs\+1 buffer is one entry per request and one more: shape \[\]; got \[2\]"),
        ({"pad": -1}, r"pad: a reqs\+1 buffer's pad is 'last' .* or the integer >= 0 .*; got -1"),
        ({"pad": 0.5}, r"pad: a reqs\+1 buffer's pad is 'last'.*; got 0\.5"),
        ({"pad": "first"}, r"pad: a reqs\+1 buffer's pad is 'last'.*; got 'first'"),
        ({"dtype": "int8", "pad": 300}, r"pad: a reqs\+1 buffer's pad .*; got 300"),
    ],
)
def test_bad_cumulative_declarations_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=rf"BufferSpec 'x': {match}"):
        BufferSpec("x", "reqs+1", **kwargs)


def test_last_is_a_pad_of_cumulative_buffers_only():
    assert BufferSpec("x", "reqs+1", pad="last") == BufferSpec("x", "reqs+1")
    with pytest.raises(ValueError, match=r"pad: 'last' is not a value of dtype int32$"):
        BufferSpec("x", "reqs", pad="last")
    with pytest.raises(
        ConfigError, match=r"buffers\[0\]\.pad: '1\.5' is not a value of dtype float32 \(a quoted number"
    ):
        config_from_text("buffers:\n  - {name: x, rows: reqs, dtype: float32, pad: '1.5'}\n")


def test_cumulative_buffers_from_yaml_match_buffer_specs_and_reach_the_manager():
    config = config_from_text(
        "buffers:\n  - {name: paged_kv_indptr, rows: reqs+1, pad: last}\n"
        "  - {name: cu_seqlens_k, rows: reqs+1, dtype: int64, pad: 2}\n"
    )
    assert tuple(map(BufferSpec.from_config, config.buffers)) == (INDPTR, CU_K)
    with pytest.raises(ConfigError, match=r"buffers\[0\]\.dtype: a reqs\+1 buffer is cumulative"):
        config_from_text("buffers:\n  - {name: x, rows: reqs+1, dtype: float16}")
    with pytest.raises(ConfigError, match=r"buffers\[0\]\.rows: expected tokens \| reqs \| reqs\+1 \| none"):
        config_from_text("buffers:\n  - {name: x, rows: reqs+2}")
    # declared in YAML ("last") and in code (the default 0): one buffer, the same rule
    config = make_config({"buffers": [{"name": "paged_kv_indptr", "rows": "reqs+1", "pad": "last"}]})
    manager = CaptureManager(_IndptrModel(config), config, progress=False, buffers=[INDPTR])
    assert manager.buffers.extras == (INDPTR,)


class _IndptrModel(torch.nn.Module):
    """Logits scaled per token by its request's page count, read from `paged_kv_indptr` on the device."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(config.model.vocab_size, 8)
        self.head = torch.nn.Linear(8, config.model.vocab_size)

    def forward(self, inputs) -> torch.Tensor:
        T = inputs.input_ids.shape[0]
        indptr = inputs.extras["paged_kv_indptr"]  # [R+1]
        pages = torch.cat([indptr.diff(), indptr.new_zeros(1)])  # [R+1]: the sink request R owns none
        token = torch.arange(T, dtype=torch.int32)
        request = torch.searchsorted(inputs.query_start_loc[1:], token, right=True)  # [T] in [0, R]
        return self.head(self.embed(inputs.input_ids.long()) * (1 + pages[request, None]))


def _indptr_sample(rng: np.random.Generator, num_entries: int) -> np.ndarray:
    return _offsets(rng.integers(1, 4, num_entries - 1))  # every real request owns 1 to 3 pages


@given(seed=st.integers(0, 40), num_reqs=st.integers(1, 6))
@settings(max_examples=10, deadline=None)
def test_a_model_reading_a_cumulative_buffer_replays_equal_to_eager(seed, num_reqs):
    manager = _MANAGER[0] if _MANAGER else _MANAGER.append(_captured()) or _MANAGER[0]
    rng = np.random.default_rng(seed)
    q = rng.integers(1, 3, num_reqs)
    extras = {"paged_kv_indptr": _offsets(rng.integers(0, 5, num_reqs))}
    batch = StepBatch(q, q + rng.integers(0, 8, num_reqs), rng.integers(0, 128, int(q.sum())), extras=extras)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    R = manager.last_key.num_reqs
    assert manager.buffers.host["paged_kv_indptr"][num_reqs + 1 : R + 1].tolist() == [extras["paged_kv_indptr"][-1]] * (
        R - num_reqs
    )


_MANAGER: list[CaptureManager] = []


def _captured() -> CaptureManager:
    config = make_config()
    spec = BufferSpec("paged_kv_indptr", "reqs+1", sample=_indptr_sample)
    manager = CaptureManager(_IndptrModel(config), config, progress=False, buffers=[spec])
    report = manager.capture()
    assert report.records and all(record.verified for record in report.captured)
    return manager


class _FrozenIndptrModel(_IndptrModel):
    """Reads the page counts as host values: the graph freezes the capture batch's."""

    def forward(self, inputs) -> torch.Tensor:
        host = inputs.host.extras["paged_kv_indptr"]
        scale = float(host[-1] - host[0])
        return super().forward(inputs) * scale


def test_a_forward_reading_the_cumulative_buffer_on_the_host_is_refused_at_capture():
    config = make_config(capture__sizes=[4])
    spec = BufferSpec("paged_kv_indptr", "reqs+1", sample=_indptr_sample)
    manager = CaptureManager(_FrozenIndptrModel(config), config, progress=False, buffers=[spec])
    with pytest.raises(Exception, match=r"replay differs from eager"):
        manager.capture()


def test_a_piecewise_forward_reading_a_cumulative_buffer_between_eager_ops_is_refused_naming_it():
    config = make_config({"capture.mode": "piecewise", "capture.sizes": [4]})
    manager = CaptureManager(_IndptrModel(config), config, progress=False, buffers=[INDPTR])
    with pytest.raises(
        CaptureError, match=r"the forward reads inputs\.extras\['paged_kv_indptr'\] .* outside any eager_op"
    ):
        manager.capture()


def test_one_upload_prefix_covers_the_cumulative_entries_of_a_key():
    buffers = _buffers()
    start = buffers.layout.offsets["cu_seqlens_k"]
    for R in (1, 3, MAX_REQS):
        key = GraphKey(8, R, False)
        assert buffers.layout.views(8, R).host["cu_seqlens_k"].shape == (R + 1,)
        assert buffers.upload_nbytes(key) >= start + (R + 1) * 8  # int64 entries
