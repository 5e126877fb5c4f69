"""Capture in a living engine: a capture pass writes nothing the engine owns but the null block.

An engine re-captures while requests are in flight (after a weight swap, on wake). Every KV
block a live request owns must then be bit-identical to before the pass: the verification
batch reads live blocks and writes only blocks the engine names as scratch (or nothing).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from graphcap import BatchError, BufferSpec, CaptureError, CaptureManager, StaticInputMovedError, StepBatch
from graphcap.config import ConfigError
from graphcap.models import build_model
from graphcap.testing import make_config, make_manager

MODES = {
    "full": {},
    "piecewise": {"capture.mode": "piecewise", "model.attention": "per_request"},
    "full_and_piecewise": {"capture.mode": "full_and_piecewise", "model.attention": "per_request"},
}


def _changed_blocks(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Block ids (dim 3 of the built-in cache [L, 2, KV, NB + 1, bs, D]) whose bytes differ."""
    differs = (before != after).any(dim=5).any(dim=4).any(dim=2).any(dim=1).any(dim=0)
    return set(torch.nonzero(differs).flatten().tolist())


def _live_cache(manager: CaptureManager) -> torch.Tensor:
    """Fill the built-in model's KV cache with values no capture writes, as live requests would."""
    cache = manager.model.kv_cache
    generator = torch.Generator().manual_seed(7)
    cache.copy_(torch.randn(cache.shape, generator=generator))
    return cache.clone()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("first", [True, False], ids=["first_capture", "recapture"])
def test_capture_leaves_every_kv_block_but_the_null_and_scratch_blocks_bit_identical(mode, first):
    config = make_config(MODES[mode])
    manager = make_manager(config)
    if not first:
        manager.capture()
    before = _live_cache(manager)
    report = manager.capture()
    assert report.records and all(r.verified for r in report.records)
    # Block 0 is the null block (dummy batches); block num_blocks the model's pad-slot scratch.
    assert _changed_blocks(before, manager.model.kv_cache) <= {0, config.kv_cache.num_blocks}


@pytest.mark.parametrize("restored", [True, False], ids=["put_back", "canary_not_put_back"])
def test_scratch_blocks_are_the_only_other_blocks_a_capture_writes_and_it_puts_them_back(restored, monkeypatch):
    config = make_config()
    manager = make_manager(config)
    scratch = list(range(40, 72))
    if not restored:  # graphcap.capture.restore off: what the probes wrote stays
        monkeypatch.setattr(
            "graphcap.capture.capturer.kept_blocks",
            lambda parts, scratch, keys, caches: contextlib.nullcontext(scratch),
        )
    before = _live_cache(manager)
    manager.capture(scratch_blocks=scratch)
    changed = _changed_blocks(before, manager.model.kv_cache)
    if restored:
        assert changed <= {0}, "every block but the null block as it was"
    else:
        assert changed - {0, config.kv_cache.num_blocks} <= set(scratch)
        assert changed & set(scratch), "with scratch blocks the verification batch writes its keys there"


@pytest.mark.parametrize("scratch", [(), tuple(range(1, 72))], ids=["reads_only", "writes_scratch"])
def test_the_probe_still_catches_a_host_value_frozen_into_the_graph(scratch):
    config = make_config(capture__sizes=[4])
    inner = build_model(config)

    class FrozenCount(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            return self.inner(inputs) * inputs.num_tokens  # a Python count: frozen at capture

    manager = CaptureManager(FrozenCount(), config, progress=False)
    with pytest.raises(CaptureError, match=r"partly filled batch .* froze a host value"):
        manager.capture(scratch_blocks=scratch)


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        ([0], ValueError, r"scratch_blocks holds 0; .* \[1, 72\)"),
        ([72], ValueError, r"scratch_blocks holds 72"),
        ([3, -1], ValueError, r"scratch_blocks holds -1"),
        ([1.5], ValueError, r"scratch_blocks holds 1.5"),
        (5, TypeError, "scratch_blocks must be a list of block ids; got int"),
        ("12", TypeError, "got str"),
    ],
)
def test_bad_scratch_blocks_are_refused_before_anything_is_captured(blocks, error, match):
    manager = make_manager(make_config())
    with pytest.raises(error, match=match):
        manager.capture(scratch_blocks=blocks)
    assert not manager.graphs


class StateModel(torch.nn.Module):
    """An engine model with per-request state in its own tensor (as Mamba layers keep theirs).

    `state_slot` (an engine buffer, pad 0) names each request's row of `state`; row 0 is the
    engine's null row, which padded requests share. Each step writes the request's row from its
    length, then every token reads its request's row.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.inner = build_model(config)
        self.register_buffer("state", torch.zeros(24, config.model.vocab_size))
        self.register_buffer("weight", torch.linspace(-1, 1, config.model.vocab_size))

    def forward(self, inputs):
        logits = self.inner(inputs)  # [T, V]
        qsl, T, R = inputs.query_start_loc, logits.shape[0], inputs.seq_lens.shape[0]
        req = torch.repeat_interleave(torch.arange(R + 1), torch.cat((qsl.diff(), T - qsl[R:])), output_size=T)
        slots = inputs.extras["state_slot"].long()  # [R]
        self.state.index_copy_(0, slots, inputs.seq_lens.float()[:, None] * self.weight)  # padded rows: 0
        rows = torch.cat((slots, slots.new_zeros(1))).index_select(0, req)  # [T]
        return logits + self.state.index_select(0, rows)


def test_an_engines_own_state_rows_are_untouched_by_a_recapture():
    config = make_config(capture__sizes=[4, 8])
    model = StateModel(config)
    # The engine hands graphcap rows 16-23 of its state for the capture's own batches.
    spec = BufferSpec("state_slot", "reqs", pad=0, sample=lambda rng, rows: rng.permutation(np.arange(16, 24))[:rows])
    manager = CaptureManager(model, config, buffers=[spec], progress=False)
    manager.capture()
    manager.execute(StepBatch([1, 1], [3, 5], extras={"state_slot": [4, 9]}))  # live rows 4 and 9
    model.state[1:].add_(torch.rand(model.state[1:].shape))
    before = model.state.clone()
    manager.capture()
    assert torch.equal(model.state[1:16], before[1:16])  # only the null row 0 and rows 16-23 may change


def test_a_sample_of_the_wrong_shape_is_named():
    config = make_config(capture__sizes=[4])
    spec = BufferSpec("state_slot", "reqs", pad=0, sample=lambda rng, rows: np.arange(2))
    manager = CaptureManager(StateModel(config), config, buffers=[spec], progress=False)
    with pytest.raises(
        CaptureError, match=r"BufferSpec 'state_slot': sample\(rng, 4\) returned shape \(2,\); expected \(4,\)"
    ):
        manager.capture()


def test_recapture_mid_serving_gives_the_same_logits_as_no_recapture():
    """Requests in flight on the persistent block table; one manager re-captures between steps."""
    config = make_config()
    outputs = []
    for recapture in (False, True):
        manager = make_manager(config)
        manager.capture()
        table = manager.block_table
        rng = np.random.default_rng(3)
        seq = np.array([5, 9, 2], dtype=np.int32)
        for i, blocks in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
            table.set_row(i, blocks)
        ids = rng.integers(0, 128, 16).astype(np.int32)
        logits = [manager.execute(StepBatch(seq.tolist(), seq.tolist(), ids, table)).clone()]
        for step in range(6):
            if recapture and step == 2:
                manager.capture()
            seq = seq + 1
            step_ids = rng.integers(0, 128, 3).astype(np.int32)
            logits.append(manager.execute(StepBatch(np.ones(3, np.int32), seq, step_ids, table)).clone())
        outputs.append(torch.cat(logits))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


class SlotReadModel:
    """Writes this step's values at slot_mapping and reads them back by slot (pad slot -> the null block)."""

    def __init__(self) -> None:
        self.cache = torch.zeros(72 * 4)  # TINY's KV cache: 72 blocks of 4 slots

    def forward(self, inputs):
        slots = inputs.slot_mapping.long().clamp(min=0)
        self.cache.index_copy_(0, slots, inputs.input_ids.float())
        return self.cache.index_select(0, slots)[:, None] * torch.ones(1, 8)


def test_a_model_that_reads_its_writes_back_by_slot_needs_scratch_and_is_told_so():
    config = make_config(capture__sizes=[4])
    manager = CaptureManager(SlotReadModel(), config, progress=False)
    manager.register_static("cache", manager.model.cache)
    with pytest.raises(
        CaptureError, match=r"ran without scratch blocks.*pass capture\(scratch_blocks=<free block ids>\)"
    ):
        manager.capture()
    before = manager.model.cache.clone()
    manager.capture(scratch_blocks=range(50, 72))
    changed = set(torch.nonzero(before.view(72, 4) != manager.model.cache.view(72, 4)).flatten().tolist()[::2])
    assert changed <= {0, *range(50, 72)}


# -- release, wake, resize ---------------------------------------------------------------------


def _decode(manager: CaptureManager, seq: list[int]) -> StepBatch:
    """A decode step of the requests in the persistent table's first rows."""
    return StepBatch(np.ones(len(seq), np.int32), np.array(seq, np.int32), np.arange(len(seq)) + 5, manager.block_table)


def test_release_frees_every_graph_keeps_buffers_and_registrations_and_capture_serves_again():
    config = make_config()
    manager = make_manager(config)
    extra = torch.zeros(4)
    manager.register_static("extra", extra)
    first = manager.capture()
    num_graphs = len(first.captured)
    packed, registry, plans = manager.buffers.storage()["packed"], manager.registry, manager.buffers.plans
    rotations = manager.backend.pool.num_rotations
    manager.block_table.set_row(0, [1, 2, 3])
    manager.block_table.set_row(1, [4, 5])
    batch = _decode(manager, [9, 6])
    served = manager.execute(batch).clone()

    assert manager.release() == num_graphs
    assert manager.graphs == {} and manager.backend.graphs == () and manager.backend.memory_in_use() == 0
    assert manager.backend.pool.num_rotations > rotations  # the next capture goes to a fresh pool
    asleep = manager.execute(batch).clone()  # eagerly, on the same rows
    assert manager.stats.eager["released"] == 1 and manager.dispatch(batch) is None
    torch.testing.assert_close(asleep, served)

    again = manager.capture()
    assert len(again.captured) == num_graphs and all(r.verified for r in again.captured)
    assert again.recapture == {
        "pass": 2, "after": "release()", "graphs_released": num_graphs,
        "reused": ["key schedule", "persistent buffers", "block table rows", "registered statics"],
    }  # fmt: skip
    assert f"re-capture (pass 2) after release(), which released {num_graphs} graphs" in again.summary()
    # Nothing rebuilt: the same schedule, buffers (same address), plans and table rows.
    assert manager.registry is registry and manager.buffers.plans is plans
    assert manager.buffers.storage()["packed"].data_ptr() == packed.data_ptr()
    assert manager.block_table.row(1).tolist() == [4, 5]
    torch.testing.assert_close(manager.execute(batch), served)
    assert manager.dispatch(batch) is not None
    stats = manager.stats.as_dict()
    assert (stats["captures"], stats["releases"], stats["graphs_released"]) == (2, 1, num_graphs)
    manager.register_static("extra", torch.zeros(4))  # a registration kept by release is checked again
    with pytest.raises(StaticInputMovedError, match=r"static\.extra"):
        manager.execute(batch)


def test_a_recapture_says_it_replaced_the_graphs_of_the_pass_before():
    manager = make_manager(make_config())
    assert manager.capture().recapture is None
    report = manager.capture()
    assert report.recapture["after"] == "capture()" and report.recapture["graphs_released"] == len(report.captured)
    assert manager.stats.graphs_released == len(report.captured) and manager.stats.releases == 0


def test_release_of_a_shared_backend_rotates_its_pool_only_when_no_graph_is_left():
    config = make_config(capture__sizes=[4])
    one = make_manager(config)
    two = CaptureManager(build_model(config), config, backend=one.backend, progress=False)
    one.capture()
    two.capture()
    rotations = one.backend.pool.num_rotations
    two.release()
    assert one.backend.pool.num_rotations == rotations and one.graphs  # one's graphs still use the pool
    one.release()
    assert one.backend.pool.num_rotations > rotations


def test_a_config_larger_than_the_models_cache_is_refused_naming_both_counts():
    small = build_model(make_config(kv_cache__num_blocks=40))
    with pytest.raises(
        ConfigError, match=r"kv_cache\.num_blocks: 72 blocks, but the KV cache is smaller: model\.kv_cache holds 40"
    ):
        CaptureManager(small, make_config(), progress=False)
    manager = CaptureManager(small, make_config(kv_cache__num_blocks=40), progress=False)
    manager.model.resize_kv_cache(30)  # re-allocated without telling graphcap
    with pytest.raises(ConfigError, match=r"model\.kv_cache holds 30"):
        manager.capture()


def test_resize_kv_grows_the_bound_and_every_later_step_and_capture_uses_it():
    config = make_config()
    manager = make_manager(config)
    manager.capture()
    model = manager.model
    with pytest.raises(BatchError, match=r"block id 95 at index 2 is outside the KV cache \[0, 72\)"):
        manager.block_table.set_row(0, [1, 2, 95])
    model.resize_kv_cache(120)
    with pytest.raises(StaticInputMovedError, match=r"model\.kv_cache"):  # the graphs read the old cache
        manager.execute(_decode(manager, []))
    assert manager.resize_kv(120) == len(manager.registry.planned)
    manager.block_table.set_row(0, [1, 2, 95])
    manager.block_table.set_row(1, [110, 119])
    batch = _decode(manager, [9, 6])
    eager = manager.execute(batch).clone()
    assert manager.stats.eager["kv_resized"] == 1
    report = manager.capture(scratch_blocks=range(100, 110))
    assert report.recapture["after"] == "resize_kv()" and all(r.verified for r in report.captured)
    torch.testing.assert_close(manager.execute(batch), eager)
    assert manager.dispatch(batch) is not None and manager.config.kv_cache.num_blocks == 120


def test_resize_kv_checks_the_tensors_it_is_given_and_address_checks_them_after():
    config = make_config()
    manager = make_manager(config)
    cache = torch.zeros(2, 60, 4)  # [k/v, blocks, slots]: blocks on dim 1
    with pytest.raises(
        ConfigError,
        match=r"kv_cache\.num_blocks: 70 blocks, but the KV cache is smaller: cache holds 60; "
        r"block ids up to 69 would index past it",
    ):
        manager.resize_kv(70, {"cache": cache}, block_dim=1)
    assert manager.config.kv_cache.num_blocks == 72  # refused: nothing changed
    manager.resize_kv(60, {"cache": cache}, block_dim=1)
    manager.capture()
    manager.register_static("cache", torch.zeros(2, 60, 4))  # the engine re-allocated without resize_kv
    with pytest.raises(StaticInputMovedError, match=r"static\.cache"):
        manager.execute(_decode(manager, []))


def test_resize_kv_to_fewer_blocks_refuses_rows_past_the_bound_by_name_and_changes_nothing():
    manager = make_manager(make_config())
    manager.capture()
    table = manager.block_table
    table.set_row(0, [1, 2])
    table.set_row(3, [5, 60])
    graphs = dict(manager.graphs)
    with pytest.raises(
        BatchError, match=r"block_table row 3 holds block 60 \(column 1\), outside the resized KV cache \[0, 50\)"
    ):
        manager.resize_kv(50)
    assert manager.graphs == graphs and manager.config.kv_cache.num_blocks == 72
    table.clear(3)
    manager.resize_kv(50)
    with pytest.raises(BatchError, match=r"block id 55 at index 0 is outside the KV cache \[0, 50\)"):
        table.set_row(3, [55])
    with pytest.raises(BatchError, match=r"block_table\[0, 1\] is 60, outside the KV cache \[0, 50\)"):
        table.clear(0)
        manager.execute(StepBatch([1], [5], [3], np.array([[1, 60]])))


@pytest.mark.parametrize(
    ("num_blocks", "match"),
    [
        (1, r"kv_cache\.num_blocks: must be >= 2; got 1"),
        (8, r"kv_cache\.max_model_len: 32 tokens do not fit the KV cache"),
        (True, r"kv_cache\.num_blocks: must be an integer; got True"),
    ],
)
def test_resize_kv_refuses_a_count_the_config_rules_refuse(num_blocks, match):
    manager = make_manager(make_config())
    with pytest.raises(ConfigError, match=match):
        manager.resize_kv(num_blocks)
    with pytest.raises(ConfigError, match=r"kv_cache\.groups: no group named 'window'; groups: none"):
        manager.resize_kv(80, group="window")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_release_on_cuda_gives_the_pool_back_and_capture_after_it_works():
    """The allocator side the emulated backend cannot show: freed pool memory, a fresh pool for the next pass."""
    config = make_config(device="cuda", capture__sizes=[2, 4, 8, 16])
    manager = make_manager(config)
    manager.capture()
    held = torch.cuda.memory_reserved()
    handle = manager.backend.pool.handle
    manager.release()
    assert torch.cuda.memory_reserved() < held and manager.backend.pool.handle != handle
    for _ in range(3):  # captures into a rotated pool never meet the allocator's `use_count > 0` assertion
        report = manager.capture()
        assert all(r.verified for r in report.captured)
        manager.release()
    manager.capture()
    batch = StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]])
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


@pytest.mark.parametrize(
    ("tensors", "block_dim", "error", "match"),
    [
        ({"": torch.zeros(60, 4)}, 0, TypeError, r"tensors must be named by non-empty strings .*; got ''"),
        ({"cache": torch.zeros(60, 4).to_sparse()}, 0, CaptureError, r"'static\.cache' is a Tensor without storage"),
        ({"cache": torch.zeros(60, 4)}, 2, ValueError, r"block_dim 2 is not a dim of tensors\['cache'\]"),
    ],
    ids=["empty_name", "sparse", "bad_block_dim"],
)
def test_a_refused_resize_kv_changes_nothing_and_the_graphs_keep_serving(tensors, block_dim, error, match):
    manager = make_manager(make_config())
    manager.capture()
    graphs = dict(manager.graphs)
    with pytest.raises(error, match=match):
        manager.resize_kv(60, tensors, block_dim=block_dim)
    assert manager.config.kv_cache.num_blocks == 72 and manager.buffers.limits.num_blocks == 72
    assert manager.graphs == graphs and manager.stats.releases == 0
    manager.block_table.set_row(0, [1, 65, 2])  # block 65: past the refused bound of 60
    batch = _decode(manager, [9])
    expected = manager.eager(batch).clone()
    torch.testing.assert_close(manager.execute(batch), expected)
    assert manager.last_key in graphs and manager.stats.graph_hits[manager.last_key] == 1


class _WatchedLock:
    """A manager's lock that tells its owner's thread when another thread starts waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner = threading.get_ident()
        self.other_waits = threading.Event()

    def __enter__(self) -> None:
        if threading.get_ident() != self._owner:
            self.other_waits.set()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("call", ["capture", "capture_pending"])
def test_a_capture_waiting_for_the_lock_while_resize_kv_grows_the_cache_uses_the_new_bound(call):
    # The engine grows its cache to 120 blocks while another thread's capture names scratch blocks
    # 100-109: the pass must be built under the lock, after resize_kv, or it refuses them by the old bound.
    strategy = "lazy" if call == "capture_pending" else "upfront"
    manager = make_manager(make_config(capture__strategy=strategy))
    manager.model.resize_kv_cache(120)
    lock = _WatchedLock()
    manager._scope.lock = lock
    outcome: dict[str, object] = {}

    def capture() -> None:
        try:
            outcome["result"] = getattr(manager, call)(scratch_blocks=range(100, 110))
        except Exception as exc:  # reported to the main thread
            outcome["error"] = exc
        finally:
            lock.other_waits.set()  # a capture that failed before the lock never waits for it

    with lock:
        thread = threading.Thread(target=capture)
        thread.start()
        assert lock.other_waits.wait(timeout=120), "the capture thread neither waited for the lock nor ended"
        manager.resize_kv(120)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert len(manager.graphs) == len(manager.registry.planned)
    assert manager.config.kv_cache.num_blocks == 120
