"""`graphcap.block_table`: rows written when they change, checked at write, named by a step."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from graphcap import CaptureManager, StepBatch
from graphcap.checks.invariants import check_invariants
from graphcap.errors import BatchError
from graphcap.keys import GraphKey
from graphcap.models import build_model
from graphcap.testing import make_config
from tests.conftest import BLOCK_SIZE, MAX_BLOCKS, MAX_REQS, NUM_BLOCKS, PAD_RULES, batches_and_keys, make_buffers

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")


def rows_of(buffers, n):
    return buffers.host["block_table"][:n].tolist()


# -- writes --------------------------------------------------------------------------------


def test_set_append_move_swap_clear_keep_each_row_its_blocks_then_the_pad_block():
    buffers = make_buffers(PAD_RULES["odd"])  # pad block 3: visible where a row holds nothing
    table = buffers.block_table
    table.set_row(0, [5, 6])
    table.append(0, [7])
    table.set_row(2, np.array([9], np.int64))
    assert [table.num_blocks(i) for i in range(3)] == [3, 0, 1]
    assert table.row(0).tolist() == [5, 6, 7] and table.top == 3
    assert rows_of(buffers, 3) == [[5, 6, 7, 3, 3, 3], [3] * 6, [9, 3, 3, 3, 3, 3]]
    table.move(2, 1)  # condense: row 2's request moves into the free row 1
    assert rows_of(buffers, 3) == [[5, 6, 7, 3, 3, 3], [9, 3, 3, 3, 3, 3], [3] * 6] and table.top == 2
    table.swap(0, 1)
    assert rows_of(buffers, 2) == [[9, 3, 3, 3, 3, 3], [5, 6, 7, 3, 3, 3]]
    table.set_row(1, [8])  # shrinking clears the columns it no longer holds
    assert rows_of(buffers, 2)[1] == [8, 3, 3, 3, 3, 3]
    table.clear(1)
    assert table.top == 1 and table.num_blocks(1) == 0
    table.reset()
    assert table.top == 0 and rows_of(buffers, MAX_REQS) == [[3] * MAX_BLOCKS] * MAX_REQS
    with pytest.raises(ValueError, match="read-only"):
        table.row(0)[0] = 1


def test_truncate_keeps_a_prefix_of_a_row_and_pads_the_rest():
    buffers = make_buffers(PAD_RULES["odd"])  # pad block 3
    table = buffers.block_table
    table.set_row(0, [5, 6, 7, 8])
    table.set_row(2, [9, 10])
    table.truncate(0, 2)  # a speculative step rolled back: its last two blocks are free again
    assert table.row(0).tolist() == [5, 6] and table.num_blocks(0) == 2
    assert rows_of(buffers, 1) == [[5, 6, 3, 3, 3, 3]]
    table.truncate(0, 2)  # the blocks it holds: nothing to do
    table.truncate(2, 0)  # to nothing: the row is empty, as after clear
    assert table.num_blocks(2) == 0 and table.top == 1 and rows_of(buffers, 3)[2] == [3] * 6
    table.append(0, [11])  # and the row grows again from where it was cut
    assert table.row(0).tolist() == [5, 6, 11]


def test_a_truncated_row_serves_steps_within_its_blocks_and_refuses_longer_ones():
    config = make_config()
    manager = CaptureManager(build_model(config), config, backend="emulated", progress=False)
    manager.capture()
    table = manager.block_table
    table.set_row(0, [1, 2, 3])  # block_size 4: room for 12 tokens
    table.truncate(0, 2)  # 8 tokens
    step = StepBatch(np.array([1], np.int32), np.array([8], np.int32), np.array([7], np.int32), table)
    expected = manager.eager(step).clone()
    torch.testing.assert_close(manager.execute(step), expected)
    longer = StepBatch(np.array([1], np.int32), np.array([9], np.int32), np.array([7], np.int32), table)
    with pytest.raises(BatchError, match=r"request 0 has seq_len 9, which needs 3 blocks of 4, but row 0 .* holds 2"):
        manager.execute(longer)


def test_a_write_changes_only_the_blocks_it_writes():
    buffers = make_buffers()
    table = buffers.block_table
    table.set_row(1, [1, 2, 3])
    table.set_row(4, [4])
    before = buffers.packed_host.copy()
    table.append(4, [5, 6])
    changed = np.flatnonzero(buffers.packed_host.view(np.int32) != before.view(np.int32))
    start = (buffers.host["block_table"][4, 1:3].ctypes.data - buffers.packed_host.ctypes.data) // 4
    assert changed.tolist() == [start, start + 1]


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda t: t.set_row(-1, [1]), r"set_row: row -1 is outside 0\.\.7"),
        (lambda t: t.set_row(MAX_REQS, [1]), rf"set_row: row {MAX_REQS} is outside"),
        (lambda t: t.append(True, [1]), r"append: row must be an integer; got True"),
        (lambda t: t.clear(1.0), r"clear: row must be an integer; got 1\.0"),
        (lambda t: t.set_row(0, [1, -2]), rf"set_row\(row 0\): block id -2 at index 1 is outside the KV cache \[0, {NUM_BLOCKS}\)"),
        (lambda t: t.append(1, [NUM_BLOCKS]), rf"append\(row 1\): block id {NUM_BLOCKS} at index 0 is outside"),
        (lambda t: t.set_row(0, [0]), r"set_row\(row 0\): block id 0 at index 0 is the null block, which padded"),
        (lambda t: t.append(1, [3, 0]), r"append\(row 1\): block id 0 at index 1 is the null block"),
        (lambda t: t.set_row(0, [[1, 2]]), r"block ids must be 1-D; got shape \(1, 2\)"),
        (lambda t: t.set_row(0, [1.5]), r"block ids must be integers; got dtype float64"),
        (lambda t: t.set_row(0, [[1], [2, 3]]), r"block ids must be a 1-D array of integers"),
        (lambda t: t.set_row(0, [1] * (MAX_BLOCKS + 1)), rf"would hold {MAX_BLOCKS + 1} blocks; a row holds at most {MAX_BLOCKS}"),
        (lambda t: t.append(1, [1] * MAX_BLOCKS), rf"would hold {MAX_BLOCKS + 2} blocks"),
        (lambda t: t.move(1, MAX_REQS), rf"move: row {MAX_REQS} is outside"),
        (lambda t: t.truncate(MAX_REQS, 0), rf"truncate: row {MAX_REQS} is outside"),
        (lambda t: t.truncate(1, 3), r"truncate\(row 1\): num_blocks 3 is outside 0\.\.2 \(the blocks the row holds\); truncate keeps a prefix"),
        (lambda t: t.truncate(1, -1), r"truncate\(row 1\): num_blocks -1 is outside 0\.\.2"),
        (lambda t: t.truncate(1, 1.0), r"truncate\(row 1\): num_blocks must be an integer; got 1\.0"),
        (lambda t: t.truncate(1, True), r"truncate\(row 1\): num_blocks must be an integer; got True"),
    ],
)  # fmt: skip
def test_bad_writes_are_refused_before_anything_changes(write, match):
    buffers = make_buffers()
    table = buffers.block_table
    table.set_row(1, [1, 2])
    before, counts = buffers.packed_host.copy(), table.counts.copy()
    with pytest.raises(BatchError, match=match):
        write(table)
    assert buffers.packed_host.tobytes() == before.tobytes() and table.counts.tolist() == counts.tolist()


class _Upload:
    """Stands in for the CUDA event of the last upload (the CPU has no asynchronous upload)."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_writes_wait_once_for_the_upload_still_reading_the_pinned_rows():
    buffers = make_buffers()
    upload = _Upload()
    buffers.layout._copy_done, buffers.layout.upload_pending = upload, True  # as after a CUDA step's upload
    buffers.block_table.set_row(0, [1])
    buffers.block_table.append(0, [2])
    assert upload.waits == 1  # one wait, then the rows are the host's until the next upload
    buffers.layout.upload_pending = True
    with pytest.raises(BatchError):
        buffers.block_table.set_row(0, [-1])
    assert upload.waits == 1  # a refused write touches nothing, so it does not wait either


# -- steps that name the table ---------------------------------------------------------------


@given(case=batches_and_keys() | batches_and_keys(uniform_query_len=1) | batches_and_keys(uniform_query_len=2))
@settings(max_examples=150, deadline=None)
def test_a_step_naming_its_rows_stages_what_the_same_fresh_table_stages(case):
    batch, key = case
    if batch.block_table is None:
        return
    fresh, persistent = make_buffers(PAD_RULES["odd"]), make_buffers(PAD_RULES["odd"])
    for row, blocks in enumerate(batch.block_table):
        persistent.block_table.set_row(row, blocks)
    named = StepBatch(batch.query_lens, batch.seq_lens, batch.input_ids, persistent.block_table)
    expected = fresh.stage(batch, key)
    staged = persistent.stage(named, key)
    check_invariants(staged, "full")
    for name in FIELDS:
        assert torch.equal(getattr(staged, name), getattr(expected, name)), name


def _table_buffers(poison=False):
    buffers = make_buffers(poison=poison)
    table = buffers.block_table
    table.set_row(0, [1, 2])  # 8 tokens
    table.set_row(1, [3])  # 4 tokens
    return buffers, table


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "key", "match"),
    [
        ([1, 1], [5, 5], GraphKey(2, 2, True), r"request 1 has seq_len 5, which needs 2 blocks of 4, but row 1 of the block table holds 1"),
        ([2, 1], [8, 5], GraphKey(3, 2, False), r"request 1 has seq_len 5, which needs 2 blocks of 4, but row 1"),
        ([1, 1], [3, 0], GraphKey(2, 2, True), r"seq_lens\[1\] is 0"),
        ([1, 1], [3, -4], GraphKey(2, 2, True), r"seq_lens\[1\] is -4"),
        ([1, 1, 1], [3, 2, 1], GraphKey(4, 4, False), r"request 2 has seq_len 1, which needs 1 blocks of 4, but row 2 of the block table holds 0"),
        ([1], [3], GraphKey(2, 2, False), r"row 1 of the block table holds 1 blocks but the step has 1 requests and its key pads to 2"),
        ([1], [3], GraphKey(1, 1, False), None),  # row 1 lies past the key's rows: allowed
    ],
)  # fmt: skip
def test_a_step_whose_rows_do_not_hold_it_is_refused_before_any_write(query_lens, seq_lens, key, match):
    buffers, table = _table_buffers()
    batch = StepBatch(np.array(query_lens, np.int32), np.array(seq_lens, np.int32), None, table)
    before = buffers.packed_host.copy()
    if match is None:
        check_invariants(buffers.stage(batch, key), "full")
        return
    with pytest.raises(BatchError, match=match):
        buffers.stage(batch, key)
    assert buffers.packed_host.tobytes() == before.tobytes()


@pytest.mark.parametrize("block_table", [None, [[1, 2], [3, 4]]])
def test_a_fresh_table_while_rows_are_live_is_refused_and_named(block_table):
    buffers, _ = _table_buffers()
    before = buffers.packed_host.copy()
    with pytest.raises(BatchError, match=r"persistent block table holds blocks in rows 0\.\.1; pass block_table="):
        buffers.stage(StepBatch([1, 1], [3, 3], None, block_table), GraphKey(2, 2, False))
    assert buffers.packed_host.tobytes() == before.tobytes()


def test_another_buffers_table_is_refused():
    buffers, _ = _table_buffers()
    other = make_buffers()
    with pytest.raises(BatchError, match=r"block_table is a BlockTable that belongs to other buffers"):
        other.stage(StepBatch([1], [3], None, buffers.block_table), GraphKey(1, 1, False))


def test_fresh_steps_then_table_rows_leave_no_stale_blocks_in_padded_rows():
    buffers = make_buffers()
    buffers.stage(StepBatch([1] * 4, [9] * 4, None, [[7, 8, 9]] * 4), GraphKey(4, 4, True))
    buffers.block_table.set_row(0, [5, 6, 7])  # the table claims the rows the fresh step wrote
    inputs = buffers.stage(StepBatch([1], [9], None, buffers.block_table), GraphKey(4, 4, False))
    check_invariants(inputs, "full")
    assert inputs.block_table[:, :3].tolist() == [[5, 6, 7], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    buffers.block_table.reset()  # back to fresh tables
    inputs = buffers.stage(StepBatch([1], [2], None, [[4]]), GraphKey(2, 2, False))
    check_invariants(inputs, "full")


def test_poison_leaves_the_table_rows_and_staged_rows_pass():
    buffers, table = _table_buffers(poison=True)
    for _ in range(2):
        inputs = buffers.stage(StepBatch([2, 1], [8, 4], None, table), GraphKey(4, 4, False))
        check_invariants(inputs, "full")
        assert inputs.block_table[:2, :2].tolist() == [[1, 2], [3, 0]]
        assert inputs.slot_mapping[:3].tolist() == [2 * BLOCK_SIZE + 2, 2 * BLOCK_SIZE + 3, 3 * BLOCK_SIZE + 3]


# -- the manager -------------------------------------------------------------------------------


def test_manager_steps_name_the_table_capture_sets_it_aside_and_replay_equals_eager():
    config = make_config(capture__max_size=8)
    manager = CaptureManager(build_model(config), config)
    table = manager.block_table
    assert table is manager.buffers.block_table
    table.set_row(0, [1, 2, 3])
    table.set_row(1, [4, 5])
    manager.capture()  # dummy batches stage the null block; the rows come back afterwards
    assert table.row(0).tolist() == [1, 2, 3] and table.row(1).tolist() == [4, 5]
    manager.model.reset_kv_cache()
    prefill = StepBatch(np.array([5, 3]), np.array([5, 3]), np.arange(8), table)
    assert manager.dispatch(prefill) is not None
    first = manager.execute(prefill).clone()
    decode = StepBatch(np.array([1, 1], np.int32), np.array([6, 4], np.int32), np.array([9, 10]), table)
    second = manager.execute(decode).clone()
    manager.model.reset_kv_cache()
    fresh = [[1, 2, 3], [4, 5, 0]]
    table.reset()
    torch.testing.assert_close(first, manager.eager(StepBatch([5, 3], [5, 3], np.arange(8), fresh)))
    torch.testing.assert_close(second, manager.eager(StepBatch([1, 1], [6, 4], [9, 10], fresh)))


class _Event:
    """Stands in for `torch.cuda.Event`: records and waits are counted (the CPU copy is synchronous)."""

    log: ClassVar[list[str]] = []

    def record(self, stream=None) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


def test_each_step_uploads_its_prefix_once_and_host_writes_wait_for_the_previous_upload(monkeypatch):
    """The CUDA upload protocol with a separate 'device' tensor on the CPU (see docs/EMULATION.md)."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    _Event.log = []
    buffers = make_buffers()
    buffers.layout.device_tensor = torch.zeros_like(buffers.layout.host_tensor)  # as on CUDA: a second copy
    table = buffers.block_table
    table.set_row(0, [1, 2])
    batch = StepBatch(np.ones(1, np.int32), np.array([6], np.int32), np.array([7], np.int32), table)
    key = GraphKey(2, 2, False)
    buffers.stage(batch, key)
    end = buffers.upload_nbytes(key)
    assert torch.equal(buffers.layout.device_tensor[:end], buffers.layout.host_tensor[:end])
    assert not buffers.layout.device_tensor[end:].any()  # one prefix, not the whole buffer
    table.append(0, [3])  # waits: the upload may still read the pinned rows
    table.set_row(1, [4])  # no second wait
    buffers.stage(StepBatch(np.ones(2, np.int32), np.array([9, 3], np.int32), None, table), key)
    assert _Event.log == ["record", "wait", "record"]
    assert buffers.layout.device_tensor[:end].numpy().tobytes() == buffers.packed_host[:end].tobytes()
