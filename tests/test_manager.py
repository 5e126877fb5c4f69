"""CaptureManager end to end on the CPU (emulated backend) with the reference model."""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest
import torch

from graphcap import CaptureError, CaptureManager, ConfigError, GraphKey, InvariantViolation, StepBatch, load_config
from graphcap.keys import NOT_CAPTURED_WARNING
from graphcap.models import build_model
from graphcap.testing import Workload
from tests.configs import SMALL


def make_manager(**overrides):
    config = load_config(overrides={**SMALL, **{k.replace("__", "."): v for k, v in overrides.items()}})
    manager = CaptureManager(build_model(config), config, progress=False)
    return manager


@pytest.fixture(scope="module")
def default_manager():
    """The embedded default config, captured once for the module."""
    config = load_config(overrides={"device": "cpu"})
    manager = CaptureManager(build_model(config), config, progress=False)
    report = manager.capture()
    assert len(report.captured) == len(manager.registry.planned)
    return manager


def assert_step_matches_eager(manager, batch):
    out = manager.execute(batch).clone()
    ref = manager.eager(batch)
    torch.testing.assert_close(out, ref)
    return out


def test_decode_loop_replay_equals_eager_at_every_step(default_manager):
    manager = default_manager
    manager.model.reset_kv_cache()
    workload = Workload(manager.config, seed=0, chunk=24)
    for prompt_len in (5, 17, 33, 2, 40):
        workload.add(prompt_len, max_new_tokens=int(workload.rng.integers(3, 30)))
    hits_before = sum(manager.stats.graph_hits.values())
    crossed_block = False
    for step in range(80):
        if step % 7 == 3:
            workload.add_random(max_prompt_len=60)
        if not workload.running:
            break
        batch = workload.next_batch(max_tokens=64)
        # a decode token at a position that is a multiple of block_size opens a new block
        crossed_block |= bool(((batch.query_lens == 1) & ((batch.seq_lens - 1) % 16 == 0) & (batch.seq_lens > 1)).any())
        workload.advance(assert_step_matches_eager(manager, batch))
    assert workload.num_finished, "requests must finish during the loop"
    assert crossed_block, "decode must cross a block boundary"
    assert sum(manager.stats.graph_hits.values()) > hits_before


def test_every_batch_size_from_one_to_max_plus_one(default_manager):
    manager = default_manager
    rng = np.random.default_rng(1)
    max_size = manager.registry.sizes.max_size
    eager_before = manager.stats.eager["above_max_size"]
    for num_tokens in range(1, max_size + 2):
        num_reqs = min(num_tokens, manager.config.batching.max_num_seqs)
        q = np.full(num_reqs, num_tokens // num_reqs)
        q[: num_tokens % num_reqs] += 1
        seq = q + rng.integers(0, 40, num_reqs)
        table = np.arange(1, 1 + num_reqs * 4).reshape(num_reqs, 4)
        batch = StepBatch(q, seq, rng.integers(0, 4096, num_tokens), table)
        key = manager.dispatch(batch)
        if num_tokens > max_size:
            assert key is None
        else:
            assert key.num_tokens == manager.registry.sizes.pad(num_tokens)
            assert key.uniform == (num_reqs == num_tokens)
        assert_step_matches_eager(manager, batch)
    assert manager.stats.eager["above_max_size"] == eager_before + 1


def test_uniform_batch_takes_uniform_key_and_mixed_takes_mixed():
    manager = make_manager()
    manager.capture()
    decode = StepBatch([1, 1, 1], [4, 9, 30], [1, 2, 3], [[1, 2], [3, 4], [5, 6]])
    mixed = StepBatch([2, 1], [4, 9], [1, 2, 3], [[1, 2], [3, 4]])
    assert manager.dispatch(decode) == GraphKey(4, 4, True)
    assert manager.dispatch(mixed) == GraphKey(4, 4, False)
    for batch in (decode, mixed):
        assert_step_matches_eager(manager, batch)
    assert manager.stats.graph_hits[GraphKey(4, 4, True)] == 1
    assert manager.stats.graph_hits[GraphKey(4, 4, False)] == 1
    assert manager.stats.padded_token_waste == pytest.approx(2 / 8)


def test_mode_none_always_runs_eagerly():
    manager = make_manager(capture__mode="none")
    report = manager.capture()
    assert report.records == []
    batch = StepBatch([1], [3], [7], [[1]])
    assert manager.dispatch(batch) is None
    assert_step_matches_eager(manager, batch)
    assert manager.stats.eager == {"mode_none": 1}


def test_full_decode_only_runs_mixed_batches_eagerly():
    manager = make_manager(capture__mode="full_decode_only")
    report = manager.capture()
    assert all(r.key.uniform for r in report.records)
    decode = StepBatch([1, 1], [5, 6], [1, 2], [[1], [2]])
    mixed = StepBatch([3, 1], [5, 6], [1, 2, 3, 4], [[1], [2]])
    assert manager.dispatch(decode) == GraphKey(2, 2, True)
    assert manager.dispatch(mixed) is None
    assert_step_matches_eager(manager, decode)
    assert_step_matches_eager(manager, mixed)
    assert manager.stats.eager == {"decode_only": 1}


def test_spec_decode_uniform_query_len_four():
    manager = make_manager(capture__uniform_query_len=4)
    report = manager.capture()
    assert all(r.key.num_tokens % 4 == 0 for r in report.records)
    rng = np.random.default_rng(2)
    for num_reqs in (1, 2, 3):
        seq = rng.integers(4, 60, num_reqs)
        table = np.arange(1, 1 + num_reqs * 4).reshape(num_reqs, 4)
        batch = StepBatch([4] * num_reqs, seq, rng.integers(0, 512, 4 * num_reqs), table)
        key = manager.dispatch(batch)
        assert key.uniform and key.num_tokens == manager.registry.sizes.pad(4 * num_reqs)
        assert key.num_reqs == key.num_tokens // 4
        assert_step_matches_eager(manager, batch)


def test_founding_bug_is_stopped_by_invariants_before_the_model_runs(monkeypatch):
    manager = make_manager()
    manager.capture()
    calls = []
    forward = manager._forward
    monkeypatch.setattr(manager, "_forward", lambda inputs: calls.append(1) or forward(inputs))
    _break_query_start_loc_tail(monkeypatch, manager)
    cache_before = manager.model.kv_cache.clone()
    batch = StepBatch([3], [3], [1, 2, 3], [[1]])  # pads to 4 tokens, 4 requests: 3 padded
    with pytest.raises(InvariantViolation, match="query_start_loc") as info:
        manager.execute(batch)
    assert info.value.field == "query_start_loc"
    assert (info.value.index, info.value.actual) == (2, 0)
    assert calls == []
    assert torch.equal(manager.model.kv_cache, cache_before)


def test_founding_bug_with_invariants_off_fails_like_the_real_engine(monkeypatch):
    manager = make_manager(checks__invariants="off")
    manager.capture()
    _break_query_start_loc_tail(monkeypatch, manager)
    batch = StepBatch([3], [3], [1, 2, 3], [[1]])
    assert manager.dispatch(batch) is not None  # the graph replays the broken metadata
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        manager.execute(batch)


def _break_query_start_loc_tail(monkeypatch, manager):
    """Reintroduce the founding bug: padded query_start_loc rows left at 0."""
    buffers = manager.buffers
    fill = buffers.pad.fill

    def buggy_fill(T, R, n, r, width):
        fill(T, R, n, r, width)
        buffers.host["query_start_loc"][r + 1 : R + 1] = 0

    monkeypatch.setattr(buffers.pad, "fill", buggy_fill)


def test_capture_report_records_every_key_largest_first(tmp_path):
    path = tmp_path / "report.json"
    manager = make_manager(report__path=str(path))
    report = manager.capture()
    sizes = [r.key.num_tokens for r in report.records]
    assert sizes == sorted(sizes, reverse=True)
    assert all(r.verified and r.memory_bytes > 0 and r.capture_seconds > 0 for r in report.records)
    assert path.exists() and '"num_graphs"' in path.read_text()
    assert "uniform" in report.table() and "graphs captured" in report.summary()


def test_capture_disables_gc_for_the_pass_and_restores_it():
    manager = make_manager()
    frozen = gc.get_freeze_count()  # not 0 on Python 3.12, nor in an engine that froze its heap
    seen = []
    forward = manager._forward
    manager._forward = lambda inputs: seen.append(gc.isenabled()) or forward(inputs)
    manager.capture()
    assert seen and not any(seen)
    assert gc.isenabled() and gc.get_freeze_count() <= frozen  # nothing frozen (refcounts may free some)


def test_capture_leaves_a_heap_the_engine_froze_frozen():
    manager = make_manager()
    gc.freeze()  # an engine that froze its start-up heap (vLLM does)
    try:
        frozen = gc.get_freeze_count()
        manager.capture()
        assert 0 < gc.get_freeze_count() <= frozen and gc.isenabled()  # refcounts may free some, GC thaws none
    finally:
        gc.unfreeze()


def test_recapture_replaces_graphs_and_stays_correct():
    manager = make_manager()
    manager.capture()
    first = dict(manager.graphs)
    manager.capture()
    assert set(manager.graphs) == set(first)
    assert all(manager.graphs[k] is not first[k] for k in first)
    assert_step_matches_eager(manager, StepBatch([2, 1], [9, 4], [5, 6, 7], [[1], [2]]))


def test_execute_before_capture_runs_eagerly_and_counts_the_reason():
    manager = make_manager()
    assert_step_matches_eager(manager, StepBatch([1], [1], [3], [[1]]))
    assert manager.stats.eager == {"not_captured": 1}


def test_execute_before_capture_warns_once_naming_capture_and_lazy_strategy(caplog):
    manager = make_manager()
    batch = StepBatch([1], [1], [3], [[1]])
    with caplog.at_level("WARNING", logger="graphcap"):
        manager.execute(batch)
        manager.execute(batch)
        manager.eager(batch)  # the reference: never a warning
    (warned,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warned.getMessage() == NOT_CAPTURED_WARNING
    assert "manager.capture()" in warned.getMessage() and "capture.strategy: lazy" in warned.getMessage()
    assert manager.stats.eager == {"not_captured": 2}


def test_a_captured_manager_and_other_eager_reasons_do_not_warn(caplog):
    manager = make_manager(capture__mode="none")
    with caplog.at_level("WARNING", logger="graphcap"):
        manager.execute(StepBatch([1], [1], [3], [[1]]))
    assert manager.stats.eager == {"mode_none": 1} and not caplog.records


def test_a_model_on_another_device_is_refused_naming_the_tensor_the_devices_and_the_fix():
    config = load_config(overrides=SMALL)
    model = build_model(config).to("meta")
    with pytest.raises(ConfigError, match=r"^1 problem") as raised:
        CaptureManager(model, config)
    (problem,) = raised.value.problems
    assert problem.key == "device"
    assert problem.message == (
        "the model's parameter 'embed' is on meta, but graphcap stages every step on cpu (the config's device "
        "'cpu'); move the model there before CaptureManager (model.to('cpu'))"
    )
    with pytest.raises(ConfigError, match=r"buffer 'cache' is on meta.*\(CaptureManager\(device='cpu'\)\)"):
        CaptureManager(MetaCache(), config, device="cpu")
    CaptureManager(build_model(config), config, progress=False)  # the control: the same model on its device


class MetaCache(torch.nn.Module):
    """A model whose parameters are on the CPU but whose KV-cache buffer is not; a 0-dim tensor may be anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("scale", torch.tensor(1.0, device="meta"))
        self.register_buffer("cache", torch.zeros(4, device="meta"))

    def forward(self, inputs):
        return self.w


def test_model_without_forward_is_refused():
    config = load_config(overrides=SMALL)
    with pytest.raises(TypeError, match="forward"):
        CaptureManager(object(), config)


# -- prepare() and nested steps --------------------------------------------------------------


class PreparingModel(torch.nn.Module):
    """The reference model with a host-side `prepare` that does what the test asks of it."""

    def __init__(self, inner, prepare) -> None:
        super().__init__()
        self.inner, self._prepare = inner, prepare

    def prepare(self, inputs, phase: str) -> None:
        self._prepare(inputs, phase)

    def forward(self, inputs):
        return self.inner(inputs)


def preparing_manager(prepare) -> CaptureManager:
    config = load_config(overrides={**SMALL, "capture.sizes": [4], "capture.max_size": None})
    return CaptureManager(PreparingModel(build_model(config), prepare), config, progress=False)


def test_founding_bug_written_by_prepare_is_caught_before_the_replay():
    def buggy_prepare(inputs, phase):
        if phase == "replay":
            inputs.host.query_start_loc[inputs.num_reqs + 1 :] = 0  # prepare "plans" the tail

    manager = preparing_manager(buggy_prepare)
    manager.capture()
    cache = manager.model.inner.kv_cache.clone()
    with pytest.raises(InvariantViolation, match=r"query_start_loc\[3\] is 0"):
        manager.execute(StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]]))
    assert torch.equal(manager.model.inner.kv_cache, cache)  # nothing ran


def test_a_step_started_from_inside_prepare_is_refused():
    manager = None

    def reentrant_prepare(inputs, phase):
        if phase == "replay":
            manager.eager(StepBatch([1], [1]))  # would restage the buffers under the outer step

    manager = preparing_manager(reentrant_prepare)
    manager.capture()
    batch = StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]])
    with pytest.raises(CaptureError, match=r"manager\.eager\(\) was called from inside execute\(\).*do not nest"):
        manager.execute(batch)
    manager.model._prepare = lambda inputs, phase: None
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))  # usable afterwards


def test_prepare_learns_what_the_staging_feeds():
    seen = []
    manager = preparing_manager(lambda inputs, phase: seen.append((inputs.key.num_tokens, phase)))
    manager.capture()
    assert (4, "capture") in seen and any(phase == "eager" for _, phase in seen)  # verification's reference
    seen.clear()
    manager.execute(StepBatch([1], [3], [5], [[1]]))
    assert seen == [(4, "replay")]
    seen.clear()
    manager.eager(StepBatch([1], [3], [5], [[1]]))
    assert seen == [(1, "eager")]


def test_a_prepare_of_the_earlier_protocol_is_refused_by_name():
    class Old(torch.nn.Module):
        def forward(self, inputs):
            return inputs.positions.float()

        def prepare(self, inputs, capturing):
            pass

    config = load_config(overrides={**SMALL, "capture.sizes": [4], "capture.max_size": None})
    with pytest.raises(TypeError, match=r"Old.prepare takes 'capturing'.*prepare\(inputs, phase\)"):
        CaptureManager(Old(), config, progress=False)


# -- capture_context -------------------------------------------------------------------------


def test_capture_context_wraps_every_capture_and_verification_runs_after_it_exits():
    events = []

    @contextlib.contextmanager
    def graph_capture():
        events.append("enter")
        try:
            yield
        finally:
            events.append("exit")

    config = load_config(overrides={**SMALL, "capture.sizes": [2, 4], "capture.max_size": None})
    model = build_model(config)
    forward = model.forward
    model.forward = lambda inputs: events.append("forward") or forward(inputs)
    manager = CaptureManager(model, config, progress=False, capture_context=graph_capture)
    manager.capture()
    assert events[0] == "enter" and events.count("enter") == 1 and events.count("exit") == 1
    exit_at = events.index("exit")
    assert "forward" in events[1:exit_at]  # every warmup and capture ran inside it
    assert "forward" in events[exit_at + 1 :]  # verification's eager runs after it exited
    events.clear()
    manager.execute(StepBatch([1], [3], [5], [[1]]))
    assert events == ["forward"] or events == []  # replays and steps run outside it


def test_capture_context_exits_when_the_pass_fails_and_a_non_callable_is_refused():
    events = []

    @contextlib.contextmanager
    def graph_capture():
        events.append("enter")
        try:
            yield
        except RuntimeError as exc:
            events.append(f"exit after {exc}")
            raise

    config = load_config(overrides={**SMALL, "capture.sizes": [2], "capture.max_size": None})
    model = build_model(config)
    model.forward = lambda inputs: (_ for _ in ()).throw(RuntimeError("broken forward"))
    manager = CaptureManager(model, config, progress=False, capture_context=graph_capture)
    with pytest.raises(CaptureError, match="broken forward"):
        manager.capture()
    assert events[0] == "enter" and events[1].startswith("exit after capturing")  # it saw the failure
    with pytest.raises(TypeError, match="capture_context must be a callable returning a context manager"):
        CaptureManager(model, config, progress=False, capture_context=object())
