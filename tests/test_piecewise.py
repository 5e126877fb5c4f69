"""Piecewise capture: graphs between `eager_op` calls, the ops run eagerly on the real batch.

The reference model with `model.attention: per_request` attends through a Python loop over
requests that reads lengths with `.item()`: no graph can hold it. In the modes `piecewise`
and `full_and_piecewise` it runs eagerly between graph pieces, and every step up to the
largest size replays a graph; uniform decode steps replay full graphs in
`full_and_piecewise` (the loop's capturable stand-in runs inside them).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap import (
    CaptureError,
    CaptureManager,
    CaptureUnsafeError,
    InvariantViolation,
    StaticInputMovedError,
    StepBatch,
)
from graphcap.keys import GraphKey, KeyRegistry, Mode, StepStats
from graphcap.models import build_model
from graphcap.piecewise import current_inputs, eager_op, running
from graphcap.testing import MOVES, Workload, make_config, make_manager
from graphcap.workload import fill_batch

PIECEWISE = {"model.attention": "per_request", "model.num_layers": 2}
MODES = ("piecewise", "full_and_piecewise")


class Forward(torch.nn.Module):
    """The reference model of `config` (`inner`) under a test's own `forward(inner, inputs)`."""

    def __init__(self, config, forward) -> None:
        super().__init__()
        self.inner, self.fn = build_model(config), forward

    def forward(self, inputs):
        return self.fn(self.inner, inputs)


def with_model(config, model):
    """A manager of `config` that captures `model` instead of the reference model."""
    torch.set_num_threads(1)
    return CaptureManager(model, config, progress=False)


@pytest.fixture(scope="module", params=MODES)
def captured(request):
    config = make_config(PIECEWISE, capture__mode=request.param)
    manager = make_manager(config)
    report = manager.capture()
    return manager, report


def test_every_key_is_captured_and_verified_with_its_pieces(captured):
    manager, report = captured
    pieces = [r for r in report.records if r.key.piecewise]
    assert [r.key.num_tokens for r in pieces] == [8, 4, 2]  # one per size, largest first
    assert all(r.status == "captured" and r.verified for r in report.records)
    assert all((r.pieces, r.eager_ops) == (3, 2) for r in pieces)  # 2 layers: piece, op, piece, op, piece
    assert "3 pieces around 2 eager ops" in report.table()
    uniform = [r for r in report.records if r.key.uniform]
    assert len(uniform) == (3 if manager.config.capture.mode == "full_and_piecewise" else 0)
    assert all(r.pieces == 1 and r.eager_ops == 0 for r in uniform)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), chunk=st.sampled_from([1, 3, 5, 8]))
def test_chunked_prefill_and_decode_streams_replay_equal_to_eager(captured, seed, chunk):
    manager, _ = captured
    config = manager.config
    largest = manager.registry.sizes.max_size
    rng = np.random.default_rng(seed)
    workload = Workload(config, seed=seed, chunk=chunk)
    for _ in range(6):
        workload.add_random(24)
    manager.stats = StepStats()
    pieces = 0
    for _ in range(40):
        if len(workload.running) < 3:
            workload.add_random(24)
        batch = workload.next_batch(max_tokens=int(rng.integers(1, largest + 2)))  # every size to max + 1
        if batch.num_reqs == 0:
            break
        replayed = manager.execute(batch).clone()
        key = manager.last_key
        expected = manager.eager(batch)
        torch.testing.assert_close(replayed, expected, **config.checks.tolerance)
        if batch.num_tokens <= largest:
            assert key in manager.graphs, f"{batch.num_tokens} tokens over {batch.num_reqs} requests ran eagerly"
            full = batch.is_uniform(1) and config.capture.mode == "full_and_piecewise"
            assert key.piecewise != full, f"{batch.num_tokens} tokens over {batch.num_reqs} requests replayed {key}"
            pieces += key.piecewise
        workload.advance(expected)
    assert set(manager.stats.eager) <= {"above_max_size"}  # no fallback below the largest size
    assert manager.stats.piecewise_replays == pieces
    assert manager.stats.eager_op_calls == 2 * manager.stats.piecewise_replays
    assert manager.stats.eager_op_copies == 0  # attend_per_request writes into out=


def test_full_and_piecewise_sends_decode_to_full_graphs_and_the_rest_to_pieces():
    config = make_config(PIECEWISE, capture__mode="FULL_AND_PIECEWISE")  # vLLM's spelling
    assert config.capture.mode == "full_and_piecewise"
    registry = KeyRegistry.from_config(config)
    registry.captured.update(registry.planned)
    assert registry.dispatch(4, 4, True)[:2] == (Mode.FULL, GraphKey(4, 4, True))
    assert registry.dispatch(4, 2, False)[:2] == (Mode.PIECEWISE, GraphKey(4, None, False))
    assert registry.dispatch(3, 3, True)[:2] == (Mode.FULL, GraphKey(4, 4, True))  # one padded decode request
    assert registry.dispatch(9, 2, False) == (Mode.EAGER, GraphKey(9, 2, False), "above_max_size")


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(1, 8), data=st.data())
def test_a_piecewise_mode_replays_every_step_up_to_the_max_with_its_own_request_count(num_tokens, data):
    """Piecewise keys are token counts alone: any request count that fits replays the padded size."""
    num_reqs = data.draw(st.integers(1, min(num_tokens, 8)))
    registry = KeyRegistry.from_config(make_config(PIECEWISE, capture__mode="piecewise"))
    registry.captured.update(registry.planned)
    mode, key, reason = registry.dispatch(num_tokens, num_reqs, data.draw(st.booleans()))
    assert mode is Mode.PIECEWISE and reason == "" and key.num_reqs is None
    assert key.num_tokens == registry.sizes.pad(num_tokens)


def test_the_model_cannot_be_captured_whole_but_captures_in_pieces(monkeypatch):
    """Control: without a capturable stand-in, a host read in attention fails a full capture."""
    import graphcap.models.llama as llama

    @eager_op
    def attend_with_item(model, layer, q, k, v):
        if current_inputs().seq_lens[0].item() < 0:  # a host read: fatal in a graph
            raise AssertionError("unreachable")
        return model._attend(layer, q, k, v, *model._paging(current_inputs()))

    monkeypatch.setattr(llama, "attend_per_request", attend_with_item)
    with pytest.raises(CaptureUnsafeError, match=r"item"):
        make_manager(make_config(PIECEWISE, capture__mode="full")).capture()
    report = make_manager(make_config(PIECEWISE, capture__mode="piecewise")).capture()
    assert all(r.verified for r in report.records)


class Pooled(torch.nn.Module):
    """linear, a per-request mean over each request's tokens (an eager op), linear.

    `pool` writes in place through `out=` or returns a new tensor (one copy per replay).
    """

    def __init__(self, config, *, use_out: bool, width: int = 16) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.randn(config.model.vocab_size, width, generator=generator)
        self.up = torch.randn(width, width, generator=generator)
        self.down = torch.randn(width, width, generator=generator)
        self.pool = eager_op(_pool_out) if use_out else eager_op(_pool_new)
        self.forward_calls = 0

    def forward(self, inputs):
        self.forward_calls += 1
        h = self.embed.index_select(0, inputs.input_ids) @ self.up
        return self.pool(h) @ self.down


def _pool_new(h):
    return _pool_out(h)


def _pool_out(h, out=None):
    """Each real token gets its request's mean; padded tokens zero. Lengths read on the host."""
    inputs = current_inputs()
    out = torch.zeros_like(h) if out is None else out.zero_()
    qsl = inputs.query_start_loc.tolist()
    for start, end in itertools.pairwise(qsl):
        out[start:end] = h[start:end].mean(0)
    return out


@pytest.mark.parametrize("use_out, copies", [(True, 0), (False, 1)])
def test_a_replay_runs_pieces_and_ops_without_the_python_forward(use_out, copies):
    config = make_config(capture__mode="piecewise")
    model = Pooled(config, use_out=use_out)
    manager = with_model(config, model)
    report = manager.capture()
    assert all(r.pieces == 2 and r.eager_ops == 1 for r in report.records)
    calls = model.forward_calls
    rng = np.random.default_rng(1)
    for num_tokens, num_reqs in [(8, 3), (5, 5), (2, 1), (7, 2)]:
        batch = fill_batch(GraphKey(num_tokens, num_reqs, False), config, rng, num_reqs)
        replayed = manager.execute(batch).clone()
        assert model.forward_calls == calls, "a replay ran the Python forward"
        expected = manager.eager(batch)
        calls = model.forward_calls
        torch.testing.assert_close(replayed, expected)
    assert manager.stats.eager_op_calls == 4
    assert manager.stats.eager_op_copies == 4 * copies


def test_an_eager_op_is_a_plain_call_outside_steps_and_current_inputs_needs_a_step():
    h = torch.arange(12.0).view(6, 2)
    with pytest.raises(CaptureError, match=r"current_inputs\(\) was called outside a step"):
        eager_op(_pool_new)(h)
    inputs = make_manager(make_config()).buffers.stage(StepBatch([2, 4], [2, 4]), GraphKey(8, None, False))
    with running(inputs):
        pooled = eager_op(_pool_new)(torch.arange(16.0).view(8, 2))
    torch.testing.assert_close(pooled[:2], torch.tensor([[1.0, 2.0]] * 2))
    assert pooled[6:].eq(0).all()  # padded tokens


def test_a_graph_unsafe_op_outside_eager_op_is_named_at_capture():
    config = make_config(PIECEWISE, capture__mode="piecewise")

    def host_read_outside(inner, inputs):
        scale = inputs.input_ids.float().mean().item()  # outside any eager_op
        return inner(inputs) * scale

    manager = with_model(config, Forward(config, host_read_outside))
    with pytest.raises(CaptureUnsafeError, match=r"item.*test_piecewise\.py:\d+"):
        manager.capture()
    assert manager.graphs == {}


def test_request_metadata_read_between_the_ops_is_refused_at_capture():
    config = make_config(PIECEWISE, capture__mode="piecewise")

    def reads_seq_lens(inner, inputs):
        longest = inputs.seq_lens.amax()  # request-shaped: [R] changes from step to step
        return inner(inputs) + longest.float() * 0

    manager = with_model(config, Forward(config, reads_seq_lens))
    with pytest.raises(CaptureError, match=r"reads inputs\.seq_lens .*test_piecewise\.py:\d+ outside any eager_op"):
        manager.capture()


def test_request_metadata_passed_to_an_eager_op_is_refused():
    config = make_config(capture__mode="piecewise")
    op = eager_op(lambda h, seq_lens: h * seq_lens.float().mean())
    manager = with_model(config, Forward(config, lambda inner, inputs: op(inputs.input_ids.float(), inputs.seq_lens)))
    with pytest.raises(CaptureError, match=r"is passed inputs\.seq_lens.*current_inputs\(\)"):
        manager.capture()


def test_an_op_whose_result_shape_follows_the_metadata_is_refused_at_verification():
    config = make_config(capture__mode="piecewise")
    op = eager_op(lambda h: h[: current_inputs().num_tokens].clone())  # shape = the real token count
    manager = with_model(
        config, Forward(config, lambda inner, inputs: op(inputs.input_ids.float()).sum(0, keepdim=True))
    )
    with pytest.raises(CaptureError, match=r"returned \(\d+,\) torch.float32 where capture saw \(8,\)"):
        manager.capture()


def test_the_founding_bug_written_by_prepare_is_caught_before_the_first_piece():
    config = make_config(PIECEWISE, capture__mode="piecewise")
    model = build_model(config)
    manager = with_model(config, model)
    manager.capture()

    def buggy_prepare(inputs, phase):
        if phase == "replay":
            inputs.host.query_start_loc[inputs.num_reqs] = 0  # offsets go backwards

    manager._prepare = buggy_prepare
    pieces = manager.graphs[GraphKey(4, None, False)].pieces
    replayed = []
    pieces[0].replay = lambda: replayed.append(1)
    cache = model.kv_cache.clone()
    with pytest.raises(InvariantViolation, match=r"query_start_loc"):
        manager.execute(StepBatch([1, 2], [3, 4], [5, 6, 7], [[1], [2]]))
    assert replayed == [] and torch.equal(model.kv_cache, cache)


@pytest.mark.parametrize("move", MOVES[:4], ids=lambda m: m.name.split(" (")[0])
def test_a_piece_reading_a_tensor_that_moved_is_refused(move):
    config = make_config(PIECEWISE, capture__mode="piecewise")
    manager = make_manager(config)
    manager.register_static("extra", torch.zeros(8))
    manager.capture()
    batch = StepBatch([2, 1], [5, 3], [1, 2, 3], [[1, 2], [3, 0]])
    manager.execute(batch)
    move.apply(manager)
    with pytest.raises(StaticInputMovedError, match=move.match):
        manager.execute(batch)


def test_an_out_parameter_must_default_to_none_and_be_written():
    with pytest.raises(TypeError, match=r"out parameter must default to None"):
        eager_op(lambda h, out: h)
    config = make_config(capture__mode="piecewise")
    op = eager_op(lambda h, out=None: h * 2)  # ignores out: the next piece would read stale values
    manager = with_model(config, Forward(config, lambda inner, inputs: op(inputs.input_ids.float() + 1) + 1))
    with pytest.raises(CaptureError, match=r"was given out= and returned another tensor"):
        manager.capture()


def test_eager_op_refuses_what_is_not_a_function():
    with pytest.raises(TypeError, match=r"eager_op decorates a function; got int"):
        eager_op(3)
    with pytest.raises(TypeError, match=r"eager_op\(capturable=\.\.\.\) must be a function; got str"):
        eager_op(capturable="paged")(lambda h: h)
