"""`tools/vllm_prep.py`: the vLLM-style host step yields exactly graphcap's staged real rows."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import PersistentBuffers, StepBatch
from graphcap.keys import GraphKey
from tests.tools import TOOLS, run_tool

# tools/ is not a package: its scripts import each other as top-level modules.
sys.path.insert(0, str(TOOLS))

from vllm_prep import (
    METADATA_FIELDS,
    VllmStylePrep,
    graphcap_real_rows,
    load_step,
    metadata_mismatches,
)

BLOCK_SIZE = 16
MAX_REQS = 8
MAX_TOKENS = 64
MAX_MODEL_LEN = 128
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = MAX_REQS * MAX_BLOCKS + 1  # every request can own distinct blocks; 0 is the null block
VOCAB = 1000

# One of each, reused across examples: leftovers of earlier steps must never show in the real rows.
_BUFFERS = PersistentBuffers(
    MAX_REQS,
    MAX_TOKENS,
    MAX_BLOCKS,
    "cpu",
    block_size=BLOCK_SIZE,
    num_blocks=NUM_BLOCKS,
    vocab_size=VOCAB,
    max_model_len=MAX_MODEL_LEN,
)
_PREP = VllmStylePrep(MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN, BLOCK_SIZE)


@st.composite
def steps(draw, *, decode_only: bool) -> tuple[list[int], list[int], list[int], np.ndarray]:
    """A valid step: decodes, or any mix of decodes and (chunked) prefills; distinct non-zero blocks."""
    num_reqs = draw(st.integers(1, MAX_REQS))
    query_lens: list[int] = []
    budget = MAX_TOKENS
    for i in range(num_reqs):
        q = 1 if decode_only else draw(st.integers(1, budget - (num_reqs - i - 1)))
        query_lens.append(q)
        budget -= q
    # A chunk after some context already in the cache (0: a whole prompt in one step).
    seq_lens = [q + draw(st.integers(0, MAX_MODEL_LEN - q)) for q in query_lens]
    num_tokens = sum(query_lens)
    input_ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_tokens, max_size=num_tokens))
    width = draw(st.integers(max(-(-s // BLOCK_SIZE) for s in seq_lens), MAX_BLOCKS))
    blocks = draw(st.permutations(range(1, NUM_BLOCKS)))
    block_table = np.array(blocks[: num_reqs * width], dtype=np.int32).reshape(num_reqs, width)
    return query_lens, seq_lens, input_ids, block_table


def _both(query_lens, seq_lens, input_ids, block_table, prep=_PREP) -> tuple[dict, dict]:
    """(graphcap's staged real rows, the vLLM-style rows: uploaded, or on the host without copies) for one step."""
    batch = StepBatch(np.array(query_lens), np.array(seq_lens), np.array(input_ids), block_table)
    inputs = _BUFFERS.stage(batch, GraphKey(batch.num_tokens, batch.num_reqs, False))
    loaded = load_step(prep, query_lens, seq_lens, input_ids, block_table)
    loaded.step()
    expected = graphcap_real_rows(inputs.host, batch.num_reqs, batch.num_tokens, block_table.shape[1])
    return expected, loaded.metadata()


_PREP_NO_COPIES = VllmStylePrep(MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN, BLOCK_SIZE, copies=False)


@given(step=steps(decode_only=True) | steps(decode_only=False), copies=st.booleans())
@settings(max_examples=200, deadline=None)
def test_vllm_style_rows_equal_graphcap_staged_rows(step, copies):
    query_lens, seq_lens, input_ids, block_table = step
    expected, actual = _both(query_lens, seq_lens, input_ids, block_table, _PREP if copies else _PREP_NO_COPIES)
    width = block_table.shape[1]
    for name in METADATA_FIELDS:
        got = actual[name][:, :width] if name == "block_table" else actual[name]
        assert got.tolist() == expected[name].tolist(), name
    assert metadata_mismatches(expected, actual, width) == []


def test_explicit_mixed_step():
    # A decode inside its first block, a 3-token chunk in its second block, a decode that
    # starts a new block.
    block_table = np.array([[7, 0], [3, 9], [2, 5]], dtype=np.int32)
    expected, actual = _both([1, 3, 1], [5, 20, 17], [11, 21, 22, 23, 42], block_table)
    want = {
        "query_start_loc": [0, 1, 4, 5],
        "seq_lens": [5, 20, 17],
        "positions": [4, 17, 18, 19, 16],
        "slot_mapping": [7 * 16 + 4, 9 * 16 + 1, 9 * 16 + 2, 9 * 16 + 3, 5 * 16 + 0],
        "input_ids": [11, 21, 22, 23, 42],
        "block_table": [[7, 0], [3, 9], [2, 5]],
    }
    for name, values in want.items():
        got = actual[name][:, :2] if name == "block_table" else actual[name]
        assert got.tolist() == values, name
        assert expected[name].tolist() == values, name
    # vLLM's dtypes: positions and slots int64, the rest int32.
    assert {name: str(a.dtype) for name, a in actual.items()} == {
        "query_start_loc": "int32",
        "seq_lens": "int32",
        "positions": "int64",
        "slot_mapping": "int64",
        "input_ids": "int32",
        "block_table": "int32",
    }


def test_cumsum_and_arange_matches_one_arange_per_request():
    prep = VllmStylePrep(4, 16, 32)
    cu, offsets = prep._get_cumsum_and_arange(np.array([2, 5, 3], dtype=np.int32))
    assert cu.tolist() == [2, 7, 10]
    assert offsets.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]


def test_update_request_then_step_continues_the_request():
    prep = VllmStylePrep(4, 16, 64)
    batch = prep.input_batch
    # A 16-token prompt fully computed except its last token, in block 3.
    batch.add_request(list(range(100, 116)), 15, [3])
    prep.prepare_inputs(np.array([1], dtype=np.int32), 1)
    assert prep.metadata(1, 1)["slot_mapping"].tolist() == [3 * 16 + 15]
    # Its sampled token 7 is appended; the token at position 16 needs a new block, 8.
    batch.update_request(0, 16, new_token_ids=[7], new_block_ids=[8])
    prep.prepare_inputs(np.array([1], dtype=np.int32), 1)
    rows = prep.metadata(1, 1)
    assert rows["positions"].tolist() == [16]
    assert rows["input_ids"].tolist() == [7]
    assert rows["slot_mapping"].tolist() == [8 * 16]
    assert rows["seq_lens"].tolist() == [17]
    assert rows["block_table"][0, :2].tolist() == [3, 8]


def test_metadata_reads_the_uploaded_copy_not_the_host_buffers():
    loaded = load_step(_PREP, [2], [2], [5, 6], np.array([[4]], dtype=np.int32))
    loaded.step()
    _PREP.positions.np[:2] = -1
    _PREP.input_ids.np[:2] = -1
    _PREP.input_batch.block_table.slot_mapping_np[:2] = -1
    rows = loaded.metadata()
    assert rows["positions"].tolist() == [0, 1]
    assert rows["input_ids"].tolist() == [5, 6]
    assert rows["slot_mapping"].tolist() == [64, 65]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "input_ids", "block_table", "match"),
    [
        ([], [], [], np.zeros((0, 1), dtype=np.int32), "requests"),
        ([0], [3], [], np.ones((1, 1), dtype=np.int32), "query_len"),
        ([4], [3], [1, 2, 3, 4], np.ones((1, 1), dtype=np.int32), "query_len"),
        ([2], [3], [1], np.ones((1, 1), dtype=np.int32), "input ids"),
        ([1], [40], [1], np.ones((1, 2), dtype=np.int32), "block_table"),
    ],
)
def test_load_step_refuses_steps_a_scheduler_would_not_make(query_lens, seq_lens, input_ids, block_table, match):
    with pytest.raises(ValueError, match=match):
        load_step(_PREP, query_lens, seq_lens, input_ids, block_table)


def test_without_copies_nothing_is_uploaded_and_the_pad_tails_are_left_alone():
    prep = VllmStylePrep(4, 16, 64, copies=False)
    prep.query_start_loc.np[:] = prep.seq_lens.np[:] = -7
    load_step(prep, [2, 1], [2, 5], [5, 6, 7], np.array([[4], [5]], dtype=np.int32)).step()
    assert prep.query_start_loc.np.tolist() == [0, 2, 3, -7, -7] and prep.seq_lens.np.tolist() == [2, 5, -7, -7]
    for buffer in (prep.query_start_loc, prep.seq_lens, prep.input_ids, prep.positions):
        assert not buffer.gpu.any()
    copying = VllmStylePrep(4, 16, 64)
    load_step(copying, [2, 1], [2, 5], [5, 6, 7], np.array([[4], [5]], dtype=np.int32)).step()
    assert copying.query_start_loc.gpu.tolist() == [0, 2, 3, 3, 3] and copying.seq_lens.gpu.tolist() == [2, 5, 0, 0]


@pytest.mark.parametrize("copies", ["off", "on"])
def test_bench_stage_compare_quick_runs(copies):
    result = run_tool("bench_stage.py", "--compare", "--quick", "--peer-copies", copies, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    for column in ("graphcap med", "table med", "vllm med", "ratio", "table ratio", "round ratio p10-p90", "min-max"):
        assert column in header
    assert any(("uploads" if copies == "on" else "metadata computation only") in line for line in lines)
    rows = [line for line in lines if line.startswith(("decode", "mixed"))]
    assert [row.split("  ")[0] for row in rows] == [
        "decode 1 reqs",
        "decode 8 reqs",
        "decode 64 reqs",
        "decode 256 reqs",
        "decode 1024 reqs",
        "mixed 4x512 + 252 dec",
    ]
