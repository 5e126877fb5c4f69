"""The CUDA backend inside a living engine, on a real GPU: the memory-budget reservation is what captures
use and it follows the pool, the process-wide sync-debug mode stays off beside the engine's threads, the
capture error mode lets another thread allocate during a capture, the engine's generators replay fresh
random numbers, and piecewise graphs replayed in any order equal eager. Skipped without CUDA;
`tools/gpu_check.py` runs this file. tests/backends/test_cuda_*_simulated.py show the same on the CPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from graphcap import CaptureManager, StepBatch
from graphcap.backends import CaptureError, CaptureUnsafeError, get_backend
from graphcap.backends.cuda import SMALL_SEGMENT
from graphcap.models import build_model
from graphcap.testing import make_config, make_manager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 1 << 20
BIG_LOGITS = {"device": "cuda", "model.vocab_size": 65536}  # 8 tokens of fp32 logits: 2 MiB, a large block


def _decode(num_reqs: int) -> StepBatch:
    table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
    return StepBatch(np.ones(num_reqs, np.int32), np.full(num_reqs, 9), np.arange(num_reqs), table)


def _pool_segments(handle) -> dict[str, int]:
    """Bytes of the allocator's segments in pool `handle`, by segment type (large, small)."""
    found = {"large": 0, "small": 0}
    wanted = tuple(handle)
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == wanted:
            found[segment["segment_type"]] += segment["total_size"]
    return found


def _lazy_pool_growth(budget: int | None) -> tuple[dict, dict]:
    """The pool's segments after the reservation, then after `capture_pending()` captured every key."""
    config = make_config(BIG_LOGITS, capture__strategy="lazy", capture__memory_budget=budget)
    manager = make_manager(config)
    manager.capture()
    handle = manager.backend.pool.handle
    before = _pool_segments(handle)
    assert manager.capture_pending() == len(manager.registry.planned)
    assert manager.backend.pool.handle == handle
    after = _pool_segments(handle)
    batch = _decode(3)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch), **config.checks.tolerance)
    manager.release()
    return before, after


def test_lazy_captures_take_their_memory_from_the_reservation():
    held, used = _lazy_pool_growth(256 * MiB)
    assert held["large"] >= 250 * MiB and held["small"] >= SMALL_SEGMENT
    assert used == held, f"captures inside the reservation took new segments: {held} -> {used}"
    bare_before, bare_after = _lazy_pool_growth(None)  # the control: without it, the same captures do
    assert bare_after["large"] > bare_before["large"] and bare_after["small"] > bare_before["small"]


def test_after_a_failed_capture_the_reservation_is_in_the_fresh_pool_and_the_old_one_is_freed():
    backend = get_backend("cuda", "cuda")
    backend.reserve(128 * MiB)
    old = backend.pool.handle
    x = torch.randn(1 << 20, device="cuda")
    backend.warmup(lambda: x * 2, num_warmups=1)

    def broken():
        x * 2
        raise RuntimeError("the forward broke")

    with pytest.raises(RuntimeError, match="the forward broke"):
        backend.capture(broken, {"x": x}, name="broken")
    assert backend.pool.handle != old and backend.pool.reservation.handle == backend.pool.handle
    assert _pool_segments(old) == {"large": 0, "small": 0}  # given back: nothing left in the old pool
    assert _pool_segments(backend.pool.handle)["large"] >= 120 * MiB
    graph = backend.capture(lambda: x * 2, {"x": x}, name="after")
    torch.testing.assert_close(graph.replay(), x * 2)
    reserved = torch.cuda.memory_reserved()
    graph.release()
    backend.reset()
    torch.cuda.empty_cache()
    assert reserved - torch.cuda.memory_reserved() >= 120 * MiB  # reset gives the reservation back


def test_release_of_a_passed_in_backend_gives_the_budget_back_to_the_device():
    config = make_config({"device": "cuda"}, capture__memory_budget=256 * MiB)
    backend = get_backend("cuda", "cuda")
    manager = CaptureManager(build_model(config), config, backend=backend, progress=False)
    manager.capture()
    held = torch.cuda.memory_reserved()
    manager.release()
    assert backend.reserved_bytes is None and held - torch.cuda.memory_reserved() >= 250 * MiB


def _syncing_thread(errors: list[str]) -> None:
    """What an engine's output thread does: read a value back (a synchronizing copy)."""
    try:
        torch.ones(1, device="cuda").item()
    except RuntimeError as exc:
        errors.append(str(exc).splitlines()[0])


class OtherThreadSyncs(torch.nn.Module):
    """The reference model; each of its forwards runs an engine thread's `.item()` to completion first."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.errors = inner, []

    def forward(self, inputs):
        if not torch.cuda.is_current_stream_capturing():
            thread = threading.Thread(target=_syncing_thread, args=(self.errors,))
            thread.start()
            thread.join(timeout=60)
        return self.inner(inputs)


@pytest.mark.parametrize("opted_in", [False, True])
def test_another_threads_sync_fails_only_where_the_process_wide_mode_is_turned_on(opted_in):
    config = make_config({"device": "cuda", "capture.strategy": "lazy", "checks.sync_debug": opted_in})
    model = OtherThreadSyncs(build_model(config))
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    assert manager.capture_pending() == len(manager.registry.planned)
    if opted_in:  # the mode is process-wide: the engine's thread was refused its sync
        assert model.errors and all("synchronizing CUDA operation" in e for e in model.errors)
    else:
        assert model.errors == []
    model.errors.clear()
    upfront = make_config({"device": "cuda"})
    other = OtherThreadSyncs(build_model(upfront))
    CaptureManager(other, upfront, progress=False).capture()  # upfront, before serving: the preflight's check
    assert len(other.errors) == len(make_manager(upfront).registry.planned)  # the preflight of each key


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_another_thread_allocating_during_capture_invalidates_it_only_under_global(mode):
    backend = get_backend("cuda", "cuda", capture_error_mode=mode)
    x = torch.randn(4096, device="cuda")
    errors: list[str] = []

    def allocate() -> None:
        try:
            torch.empty(300 * MiB + 4096, dtype=torch.uint8, device="cuda")  # a fresh cudaMalloc
        except RuntimeError as exc:
            errors.append(str(exc).splitlines()[0])

    def forward():
        if torch.cuda.is_current_stream_capturing():
            thread = threading.Thread(target=allocate)
            thread.start()
            thread.join(timeout=60)
        return x * 2 + 1

    backend.warmup(forward, num_warmups=1)
    if mode == "global":
        with pytest.raises((CaptureError, RuntimeError)):
            backend.capture(forward, {"x": x}, name="key")
            if errors:
                raise RuntimeError(errors[0])
    else:
        graph = backend.capture(forward, {"x": x}, name="key")
        assert errors == []
        torch.testing.assert_close(graph.replay(), x * 2 + 1)
    backend.reset()


def test_an_engines_generator_replays_fresh_random_numbers_once_registered():
    sampler = torch.Generator(device="cuda").manual_seed(7)
    scale = torch.ones(64, device="cuda")
    draw = lambda: torch.rand(64, device="cuda", generator=sampler) * scale  # noqa: E731
    unregistered = get_backend("cuda", "cuda")
    with pytest.raises(CaptureUnsafeError, match=r"torch\.rand at .* generators=\[g\]"):
        unregistered.warmup(draw, num_warmups=1)
    backend = get_backend("cuda", "cuda", generators=[sampler])
    backend.warmup(draw, num_warmups=1)
    graph = backend.capture(draw, {"scale": scale}, name="sample")
    draws = {tuple(graph.replay().flatten().tolist()) for _ in range(8)}
    assert len(draws) > 1, "every replay drew the same numbers: the generator's state did not advance"
    backend.reset()


def test_piecewise_graphs_replayed_out_of_capture_order_equal_eager():
    """Pieces of every key share one pool, captured largest first; an eager op's inputs between pieces
    are held as unowned aliases. Replaying the keys in another order than captured must read what each
    key's own pieces wrote, never another key's."""
    config = make_config(
        {"device": "cuda", "model.attention": "per_request", "capture.sizes": [1, 2, 4, 8]},
        capture__mode="piecewise",
    )
    manager = make_manager(config)
    report = manager.capture()
    assert all(r.status == "captured" for r in report.records)
    order = [1, 8, 2, 4, 1, 4, 8, 2, 2, 8]
    first: dict[int, torch.Tensor] = {}
    for num_reqs in order:  # every batch is exactly a key's size: the replay and eager shapes are equal
        batch = _decode(num_reqs)
        replayed = manager.execute(batch).clone()
        expected = manager.eager(batch)
        torch.testing.assert_close(replayed, expected, rtol=0, atol=0)
        reference = first.setdefault(num_reqs, replayed)
        torch.testing.assert_close(replayed, reference, rtol=0, atol=0)
    assert manager.stats.piecewise_replays == len(order)
