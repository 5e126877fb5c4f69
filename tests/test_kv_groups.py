"""KV-cache groups (`kv_cache.groups`): each group's block table and slot mapping staged, padded and checked
like the built-in group's, read by a hybrid model through `inputs.kv_groups[name]`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import BatchError, CaptureManager, GraphKey, InvariantViolation, StepBatch
from graphcap.checks.invariants import check_invariants
from graphcap.config import ConfigError, config_from_text
from graphcap.models import WindowedMemory, build_model, dense_reference, window_reference
from graphcap.staging import PersistentBuffers
from graphcap.testing import make_config

WINDOW = {"name": "window", "block_size": 2, "num_blocks": 90, "sliding_window": 5}
CONFIG = {"kv_cache.groups": [WINDOW]}


class Hybrid(torch.nn.Module):
    """The reference decoder plus a sliding-window memory on the group `window`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.memory = WindowedMemory(config, "window")

    def forward(self, inputs):
        return self.llama(inputs) + self.memory(inputs)

    def dense(self, tokens: list[list[int]]) -> list[torch.Tensor]:
        return [d + w for d, w in zip(dense_reference(self.llama, tokens), window_reference(self.memory, tokens))]


def _buffers(**overrides) -> PersistentBuffers:
    return PersistentBuffers.from_config(make_config({**CONFIG, **overrides}))


def _expected_slots(table: np.ndarray, q: list[int], s: list[int], block_size: int) -> np.ndarray:
    """Written apart from staging: token t of request i at position p writes table[i, p // bs] * bs + p % bs."""
    out = []
    for i, (query_len, seq_len) in enumerate(zip(q, s)):
        for p in range(seq_len - query_len, seq_len):
            out.append(int(table[i, p // block_size]) * block_size + p % block_size)
    return np.array(out, dtype=np.int64)


# -- config ------------------------------------------------------------------------------


def test_groups_load_validate_and_round_trip():
    config = make_config(CONFIG)
    (group,) = config.kv_cache.groups
    assert (group.name, group.block_size, group.num_blocks, group.sliding_window) == ("window", 2, 90, 5)
    assert config_from_text(yaml.safe_dump(config.to_dict())) == config


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([{**WINDOW, "name": "bad name"}], r"kv_cache\.groups\[0\]\.name: must be a Python identifier"),
        ([WINDOW, WINDOW], r"kv_cache\.groups\[1\]\.name: 'window' is declared twice \(also groups\[0\]\)"),
        ([{**WINDOW, "sliding_window": None, "num_blocks": 10}], r"kv_cache\.groups\[0\]\.num_blocks: 10 blocks of 2 "
         r"slots cannot hold one request's max_model_len tokens plus the null block 0: raise it to 17"),
        ([{**WINDOW, "blocks": 3}], r"kv_cache\.groups\[0\]\.blocks: unknown key \(did you mean num_blocks\?\)"),
        ([{"block_size": 2}], r"kv_cache\.groups\[0\]\.name: is required: it names ForwardInputs\.kv_groups\[name\]"),
        ([{"name": "window", "block_size": 2}], r"kv_cache\.groups\[0\]\.num_blocks: is required for group 'window': "
         r"the blocks of its own cache, null block 0 included \(it is not kv_cache\.num_blocks"),
        ("window", r"kv_cache\.groups: must be a list of group mappings"),
    ],
)  # fmt: skip
def test_a_bad_group_is_refused_naming_its_key(groups, match):
    with pytest.raises(ConfigError, match=match):
        make_config({"kv_cache.groups": groups})


def test_the_pad_block_must_exist_in_every_group():
    with pytest.raises(ConfigError, match=r"padding\.block_id: 95 is not a valid block \(kv_cache\.groups\[0\]"):
        make_config({**CONFIG, "kv_cache.num_blocks": 100, "padding.block_id": 95})


# -- staging -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_group_slots_follow_positions_and_padded_rows_hold_the_pad(data):
    buffers = _buffers()
    r = data.draw(st.integers(1, 4))
    q = data.draw(st.lists(st.integers(1, 3), min_size=r, max_size=r))
    s = [qi + data.draw(st.integers(0, 32 - qi)) for qi in q]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    main = rng.permutation(np.arange(1, 72))[: r * 8].reshape(r, 8)
    width = min(16, max(-(-si // 2) for si in s) + data.draw(st.integers(0, 2)))
    window = rng.permutation(np.arange(1, 90))[: r * width].reshape(r, width)
    key = GraphKey(16, 8, False)
    inputs = buffers.stage(StepBatch(q, s, None, main, kv_groups={"window": window}), key)
    rows = inputs.host.kv_groups["window"]
    n = sum(q)
    np.testing.assert_array_equal(rows.slot_mapping[:n], _expected_slots(window, q, s, 2))
    assert (rows.slot_mapping[n:] == -1).all() and (rows.block_table[r:] == 0).all()
    np.testing.assert_array_equal(rows.block_table[:r, :width], window)
    check_invariants(inputs, "full")
    torch.testing.assert_close(inputs.kv_groups["window"].slot_mapping, torch.from_numpy(rows.slot_mapping))


def test_a_groups_persistent_table_is_named_by_the_step_and_neither_copied_nor_scanned():
    buffers = _buffers()
    table, window = buffers.block_table, buffers.kv_groups.tables["window"]
    table.set_row(0, [1, 2, 3])
    window.set_row(0, [10, 11, 12, 13, 14])
    table.set_row(1, [4, 6])
    window.set_row(1, [20, 21])
    inputs = buffers.stage(StepBatch([2, 1], [9, 4], None, table, kv_groups={"window": window}), GraphKey(4, 2, False))
    rows = inputs.host.kv_groups["window"]
    np.testing.assert_array_equal(
        rows.slot_mapping[:3], _expected_slots(np.array([[10, 11, 12, 13, 14], [20, 21, 0, 0, 0]]), [2, 1], [9, 4], 2)
    )
    check_invariants(inputs, "full")
    with pytest.raises(BatchError, match=r"kv_groups\['window'\] \(the group's persistent table\): request 1 has "
                       r"seq_len 5, which needs 3 blocks of 2, but row 1 of the block table holds 2"):  # fmt: skip
        buffers.stage(StepBatch([1, 1], [10, 5], None, table, kv_groups={"window": window}), GraphKey(2, 2, True))


def test_graphcaps_own_batches_give_every_group_the_null_block():
    buffers = _buffers()
    inputs = buffers.stage(StepBatch([3, 2], [3, 7]), GraphKey(8, 4, False))
    rows = inputs.host.kv_groups["window"]
    assert rows.slot_mapping[:5].tolist() == [0, 1, 0, 1, 0] and (rows.block_table == 0).all()
    check_invariants(inputs, "full", dummy=True)


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        (None, r"kv_groups\['window'\] is missing: the step gives block_table, so it must give every group's table"),
        ({"window": np.array([[1, 2, 3]]), "other": np.array([[1]])}, r"kv_groups\['other'\]: no such KV-cache group"),
        ({"window": np.array([[1, 90, 3]])}, r"kv_groups\['window'\]\[0, 1\] is 90, outside the group's KV cache"),
        ({"window": np.array([[1, -2, 3]])}, r"kv_groups\['window'\]\[0, 1\] is -2; block ids are >= 0"),
        ({"window": np.array([[1, 2]])}, r"request 0 has seq_len 5, which needs 3 blocks of 2 in group 'window', but"),
        ({"window": np.ones((1, 17), int)}, r"kv_groups\['window'\] has 17 columns; the group's table holds 16"),
        ({"window": np.array([[1, 2, 3], [4, 5, 6]])}, r"kv_groups\['window'\] has 2 rows but the batch has 1"),
    ],
)
def test_a_bad_group_table_is_refused_by_name_and_nothing_is_written(groups, match):
    buffers = _buffers()
    before = buffers.packed_host.copy()
    with pytest.raises(BatchError, match=match):
        buffers.stage(StepBatch([2], [5], None, np.array([[1, 2]]), kv_groups=groups), GraphKey(4, 2, False))
    np.testing.assert_array_equal(buffers.packed_host, before)


def test_a_fresh_group_table_is_refused_while_the_groups_persistent_table_holds_rows():
    buffers = _buffers()
    buffers.kv_groups.tables["window"].set_row(0, [5, 6])
    with pytest.raises(BatchError, match=r"kv_groups\['window'\]: the step passes its own table, but the group's "
                       r"persistent block table holds blocks in rows 0\.\.0"):  # fmt: skip
        buffers.stage(
            StepBatch([1], [3], None, np.array([[1]]), kv_groups={"window": np.array([[7, 8]])}), GraphKey(2, 2, True)
        )


def test_a_group_step_on_buffers_without_groups_is_refused():
    buffers = PersistentBuffers.from_config(make_config())
    for q in ([1], [2]):  # the decode pass and the general one
        with pytest.raises(BatchError, match=r"gives kv_groups \['window'\], but kv_cache\.groups declares none"):
            buffers.stage(
                StepBatch(q, [3], None, None, kv_groups={"window": np.array([[1, 2]])}), GraphKey(2, 2, False)
            )


@pytest.mark.parametrize(
    ("field", "index", "value", "match"),
    [
        (
            "slot_mapping",
            5,
            7,
            r"kv_groups\['window'\]\.slot_mapping\[5\] is 7, expected -1: a padded token must never write",
        ),
        ("slot_mapping", 0, 3, r"kv_groups\['window'\]\.slot_mapping.*a real token writes its own request's block"),
        ("slot_mapping", 1, 180, r"kv_groups\['window'\]\.slot_mapping.*in \[0, 180\)"),
        ("block_table", (0, 4), 95, r"kv_groups\['window'\]\.block_table.*in \[0, 90\)"),
        ("block_table", (2, 0), 3, r"kv_groups\['window'\]\.block_table.*padded requests point at the pad block"),
    ],
)
def test_corrupted_group_rows_are_named_by_the_invariants(field, index, value, match):
    buffers = _buffers()
    window = np.array([[3, 4, 0], [5, 6, 7]])
    batch = StepBatch([2, 1], [4, 6], None, np.array([[1, 0], [2, 3]]), kv_groups={"window": window})
    inputs = buffers.stage(batch, GraphKey(8, 4, False))
    check_invariants(inputs, "full")
    getattr(inputs.host.kv_groups["window"], field)[index] = value
    with pytest.raises(InvariantViolation, match=match):
        check_invariants(inputs, "full")


def test_two_tokens_writing_one_group_slot_and_the_null_block_are_refused_for_real_steps():
    buffers = _buffers()
    shared = StepBatch([1, 1], [3, 3], None, np.array([[1], [2]]), kv_groups={"window": np.array([[3, 4], [3, 4]])})
    with pytest.raises(InvariantViolation, match=r"kv_groups\['window'\]\.slot_mapping.*two tokens of one step write"):
        check_invariants(buffers.stage(shared, GraphKey(2, 2, True)), "full")
    null = StepBatch([1], [1], None, np.array([[1]]), kv_groups={"window": np.array([[0]])})
    with pytest.raises(
        InvariantViolation,
        match=r"kv_groups\['window'\]\.block_table\[0, 0\].*writes this step's keys into the null block 0",
    ):
        check_invariants(buffers.stage(null, GraphKey(2, 2, False)), "full")


# -- a hybrid model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    config = make_config({**CONFIG, "checks.poison_padding": True, "capture.sizes": [2, 4, 8]})
    model = Hybrid(config)
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    return manager


def test_a_hybrid_model_replays_group_steps_equal_to_eager_and_to_a_dense_model(hybrid):
    model, rng = hybrid.model, np.random.default_rng(4)
    tokens = [rng.integers(0, 128, 5).tolist(), rng.integers(0, 128, 3).tolist()]
    main, window = np.array([[1, 2], [3, 0]]), np.array([[10, 11, 12], [20, 21, 0]])
    batch = StepBatch([5, 3], [5, 3], tokens[0] + tokens[1], main, kv_groups={"window": window})
    graph = hybrid.execute(batch).clone()
    assert hybrid.last_key == GraphKey(8, 8, False)
    torch.testing.assert_close(graph, torch.cat(model.dense(tokens)), atol=1e-4, rtol=1e-4)
    main_blocks, window_blocks = [[1, 2], [3]], [[10, 11, 12], [20, 21]]
    fresh_main, fresh_window = iter(range(40, 70)), iter(range(30, 60))
    table, groups = hybrid.block_table, hybrid.kv_group_tables["window"]
    for _ in range(4):  # decode on the persistent tables, the window sliding past freed blocks
        for i, seq in enumerate(tokens):
            seq.append(int(rng.integers(0, 128)))
            n = len(seq)
            while len(main_blocks[i]) * 4 < n:
                main_blocks[i].append(next(fresh_main))
            while len(window_blocks[i]) * 2 < n:
                window_blocks[i].append(next(fresh_window))
            for j in range((n - 5) // 2):  # columns wholly before the window: back to the null block
                window_blocks[i][j] = 0
            table.set_row(i, main_blocks[i])
            groups.set_row(i, window_blocks[i])
        batch = StepBatch(
            [1, 1], [len(t) for t in tokens], [t[-1] for t in tokens], table, kv_groups={"window": groups}
        )
        graph = hybrid.execute(batch).clone()
        assert hybrid.last_key.uniform
        torch.testing.assert_close(graph, hybrid.eager(batch))
        dense = torch.stack([d[-1] for d in model.dense(tokens)])
        torch.testing.assert_close(graph, dense, atol=1e-4, rtol=1e-4)
    assert 0 in window_blocks[0]  # the window did slide
    table.reset()
    groups.reset()


def test_a_recapture_leaves_every_live_group_block_bit_identical(hybrid):
    cache = hybrid.model.memory.cache
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(3)))
    before = cache.clone()
    report = hybrid.capture(group_scratch_blocks={"window": range(60, 90)}, scratch_blocks=range(40, 72))
    assert all(r.verified for r in report.captured)
    changed = set(torch.nonzero((cache != before).any(dim=1)).flatten().div(2, rounding_mode="floor").tolist())
    assert changed <= {0}  # the null block; the scratch blocks the probes wrote are put back (capture.restore)
    before = cache.clone()
    hybrid.capture(scratch_blocks=range(40, 72))  # no group scratch: the verification batch writes nothing
    changed = set(torch.nonzero((cache != before).any(dim=1)).flatten().div(2, rounding_mode="floor").tolist())
    assert changed <= {0, 90}


def test_resize_kv_of_a_group_moves_its_bound():
    config = make_config(CONFIG)
    manager = CaptureManager(Hybrid(config), config, progress=False)
    groups = manager.kv_group_tables["window"]
    with pytest.raises(BatchError, match=r"block id 120 at index 0 is outside the KV cache \[0, 90\)"):
        groups.set_row(0, [120])
    manager.model.memory.resize_cache(130)
    manager.resize_kv(130, {"window": manager.model.memory.cache}, group="window", block_dim=0)
    groups.set_row(0, [120, 129])
    assert manager.config.kv_cache.groups[0].num_blocks == 130 and manager.config.kv_cache.num_blocks == 72
    manager.block_table.set_row(0, [1])
    batch = StepBatch([3], [3], [1, 2, 3], manager.block_table, kv_groups={"window": groups})
    torch.testing.assert_close(
        manager.execute(batch), torch.cat(manager.model.dense([[1, 2, 3]])), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ConfigError, match=r"kv_cache\.groups\[0\]\.num_blocks: must be >= 2; got 1"):
        manager.resize_kv(1, group="window")


def test_a_group_given_in_code_without_num_blocks_is_refused_too():
    from graphcap.config.sections import KVGroupConfig

    with pytest.raises(ConfigError, match=r"kv_cache\.groups\[\]\.num_blocks: is required for group 'window'"):
        KVGroupConfig(name="window", block_size=2)


class StateSpace(torch.nn.Module):
    """A state-space group as vLLM v1 lays it out: each request's state is one block, at block_table[:, 0]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)
        spec = config.kv_cache.groups[0]
        self.register_buffer("state", torch.zeros(spec.num_blocks, config.model.vocab_size))

    def forward(self, inputs):
        out = self.llama(inputs)  # [T, vocab]
        rows = inputs.kv_groups["ssm"].block_table[:, 0].long()  # [R]: each request's state block
        qsl = inputs.query_start_loc.long()
        token_req = torch.searchsorted(qsl[1:], torch.arange(out.shape[0]), right=True).clamp(max=len(rows) - 1)
        self.state.index_copy_(0, rows, self.state.index_select(0, rows) * 0.5 + 1.0)  # the step updates it
        return out + self.state.index_select(0, rows).index_select(0, token_req)


STATE_CONFIG = {"kv_cache.groups": [{"name": "ssm", "block_size": 32, "num_blocks": 10}], "capture.on_error": "skip"}


def _state_manager() -> tuple[CaptureManager, torch.Tensor]:
    config = make_config(STATE_CONFIG)
    manager = CaptureManager(StateSpace(config), config, progress=False)
    manager.kv_group_tables["ssm"].set_row(0, [5])  # a request in flight: its state lives in block 5
    state = manager.model.state
    state.copy_(torch.randn(state.shape, generator=torch.Generator().manual_seed(9)))
    return manager, state.clone()


def test_probes_never_write_a_live_state_block_of_a_group_without_scratch_blocks():
    manager, before = _state_manager()
    manager.capture()  # requests in flight, no group_scratch_blocks
    assert torch.equal(manager.model.state[1:], before[1:]), "only the group's null block 0 was written"


def test_canary_random_group_tables_rewrite_a_live_request_s_state(monkeypatch):
    from graphcap.probe import distinct_blocks

    monkeypatch.setattr(
        "graphcap.probe._scratch_table", lambda seq, size, free, rng: distinct_blocks(seq, size, 10, rng)
    )
    manager, before = _state_manager()
    manager.capture()
    assert not torch.equal(manager.model.state[1:], before[1:]), "the hazard: a live state block rewritten"


def test_a_group_s_probe_tables_name_only_its_scratch_blocks_or_the_null_block():
    from graphcap.inputs import KVGroup
    from graphcap.keys import GraphKey
    from graphcap.probe import probe_batch, probe_fills

    group = KVGroup("ssm", 4, 40, 8)
    for key in (GraphKey(8, 8, False), GraphKey(8, 4, True), GraphKey(16, 4, False)):
        for fill in probe_fills(key, max_model_len=32):
            for scratch, allowed in (
                ((), {0}),
                ((30, 31, 33), {30, 31, 33}),
                (tuple(range(10, 40)), set(range(10, 40))),
            ):
                batch, _ = probe_batch(
                    key, max_model_len=32, block_size=4, num_blocks=72, vocab_size=128, scratch_blocks=range(40, 72),
                    groups=[group], group_scratch={"ssm": scratch}, fill=fill,
                )  # fmt: skip
                table = batch.kv_groups["ssm"]
                need = -(-batch.seq_lens // 4)
                used = {int(table[i, j]) for i in range(len(need)) for j in range(int(need[i]))}
                assert used <= allowed, (key, fill, scratch, used)
