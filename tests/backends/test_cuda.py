"""The CUDA backend on a real GPU: replay == eager, a pool per backend, outputs not kept alive,
address checks, the preflight (table, sync-debug, compile), and clean failure: a failed first
capture (its tensors still pinning the pool) and a capture CUDA invalidated leave later captures
working, and a pool whose graphs were all released takes new captures. Skipped without CUDA;
`tools/gpu_check.py` runs this file."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from graphcap.backends import (
    CaptureError,
    CaptureUnsafeError,
    StaticInputMovedError,
    check_capture_safe,
    get_backend,
)
from graphcap.backends.cuda import supports_input_liveness
from tests.backends.conftest import marked_line

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def cuda_backend() -> Iterator:
    backend = get_backend("cuda", "cuda")
    yield backend
    backend.reset()


def _persistent(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "x": torch.randn(8, 64, device="cuda", generator=g),
        "w": torch.randn(128, 64, device="cuda", generator=g),
        "slots": torch.tensor([5, 1, 7, 3, 0, 2, 6, 4], device="cuda"),
        "cache": torch.zeros(16, 128, device="cuda"),
    }


def _forward(t: dict[str, torch.Tensor]) -> torch.Tensor:
    h = F.linear(t["x"], t["w"])
    t["cache"].index_copy_(0, t["slots"], h)
    return torch.softmax(h, dim=-1) + t["cache"].index_select(0, t["slots"]).sum(-1, keepdim=True)


def test_get_backend_auto_picks_cuda_for_a_cuda_device():
    backend = get_backend("auto", "cuda")
    assert backend.name == "cuda" and backend.device.type == "cuda"
    assert backend.device.index is not None


def test_replay_equals_eager_and_rewrites_the_cache(cuda_backend):
    t = _persistent()
    static = {"x": t["x"], "slots": t["slots"]}
    cuda_backend.warmup(lambda: _forward(t), num_warmups=2)
    graph = cuda_backend.capture(lambda: _forward(t), static, name="key")
    for seed in (1, 2):
        g = torch.Generator("cuda").manual_seed(seed)
        t["x"].copy_(torch.randn(8, 64, device="cuda", generator=g))
        t["cache"].zero_()
        graph.check_addresses(static)
        replayed = graph.replay().clone()
        cache_after_replay = t["cache"].clone()
        t["cache"].zero_()
        expected = _forward(t)
        torch.testing.assert_close(replayed, expected, rtol=0, atol=0)
        torch.testing.assert_close(cache_after_replay, t["cache"], rtol=0, atol=0)
    assert graph.output.data_ptr() == graph.replay().data_ptr() and graph.output.is_inference()


def test_graphs_of_a_backend_share_its_pool_and_another_backend_has_its_own(cuda_backend):
    t = _persistent()
    graphs = []
    for rows in (8, 4, 2):  # largest first, as the manager captures
        forward = lambda r=rows: F.linear(t["x"][:r], t["w"])  # noqa: E731
        cuda_backend.warmup(forward, num_warmups=1)
        graphs.append(cuda_backend.capture(forward, {}, name=f"k{rows}"))
    assert len({repr(g.pool) for g in graphs}) == 1
    other = get_backend("cuda", "cuda")
    other.warmup(lambda: t["x"] * 3, num_warmups=1)
    assert repr(other.capture(lambda: t["x"] * 3, {}, name="other").pool) != repr(graphs[0].pool)
    shared = get_backend("cuda", "cuda", share_pool_with=cuda_backend)
    shared.warmup(lambda: t["x"] * 4, num_warmups=1)
    assert repr(shared.capture(lambda: t["x"] * 4, {}, name="shared").pool) == repr(graphs[0].pool)
    assert all(g.memory_bytes >= 0 for g in graphs)
    assert cuda_backend.memory_in_use() > 0 and cuda_backend.free_memory() > 0
    cuda_backend.reset()
    assert cuda_backend.graphs == () and graphs[0].pool is not None  # no AttributeError after release
    with pytest.raises(CaptureError, match="released"):
        graphs[0].replay()
    other.reset()
    shared.reset()


def test_an_output_is_not_kept_alive_after_capture(cuda_backend):
    x = torch.randn(1024, 1024, device="cuda")
    cuda_backend.warmup(lambda: x * 2, num_warmups=1)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    graph = cuda_backend.capture(lambda: x * 2, {}, name="key")
    # An owned 4 MiB output would still be allocated; the pool keeps the memory reserved instead.
    assert torch.cuda.memory_allocated() - allocated < x.numel() * x.element_size()
    torch.testing.assert_close(graph.replay(), x * 2, rtol=0, atol=0)


def test_replaced_input_is_refused(cuda_backend):
    t = _persistent()
    cuda_backend.warmup(lambda: t["x"] * 2, num_warmups=1)
    graph = cuda_backend.capture(lambda: t["x"] * 2, {"x": t["x"]}, name="key")
    with pytest.raises(StaticInputMovedError, match=r"'x'.*copy_\(\)"):
        graph.check_addresses({"x": t["x"].clone()})


def _nonzero_forward(t):
    return torch.nonzero(t["x"] > 0).float().sum()  # unsafe


@pytest.mark.parametrize("sync_debug", [False, True])
def test_preflight_names_the_unsafe_op_before_capture(sync_debug):
    backend = get_backend("cuda", "cuda", sync_debug=sync_debug)
    t = _persistent()
    mode_before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(CaptureUnsafeError, match=r"aten\.nonzero") as caught:
        backend.warmup(lambda: _nonzero_forward(t), num_warmups=2)
    assert marked_line(_nonzero_forward) in str(caught.value)
    assert torch.cuda.get_sync_debug_mode() == mode_before


def _sync_forward(t):
    y = t["x"] + 1
    torch.cuda.synchronize()  # unsafe: CUDA refuses it during capture (error 900) and invalidates the capture
    return y


def _upload_forward(t):
    return t["x"] + torch.tensor([1.0], device="cuda")  # a pageable copy: torch refuses it before CUDA sees it


def _end_capture_left(handle) -> bool:
    """Whether the allocator was still recording to `handle` (ending it then succeeds)."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), handle)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("forward", [_sync_forward, _nonzero_forward], ids=["sync", "nonzero"])
def test_a_capture_cuda_invalidates_leaves_nothing_recording_and_later_captures_work(cuda_backend, forward):
    """Capture runs without the checker (so compiled code stays compiled): CUDA itself refuses the op (error 900)."""
    t = _persistent()
    stream_before = torch.cuda.current_stream()
    handle = cuda_backend.pool.handle
    with pytest.raises(CaptureError, match="CUDA invalidated the capture of bad") as caught:
        cuda_backend.capture(lambda: forward(t), {}, name="bad")
    assert "check_capture_safe" in str(caught.value)
    assert cuda_backend.graphs == () and torch.cuda.current_stream() == stream_before
    assert not torch.cuda.is_current_stream_capturing()
    assert not _end_capture_left(handle)  # the allocator stopped recording to the old pool
    assert cuda_backend.pool.handle != handle  # later captures go to a fresh pool
    torch.cuda.empty_cache()  # works again: no capture is believed to be under way
    cuda_backend.warmup(lambda: t["x"] + 1, num_warmups=1)
    graph = cuda_backend.capture(lambda: t["x"] + 1, {}, name="good")
    torch.testing.assert_close(graph.replay(), t["x"] + 1, rtol=0, atol=0)


def test_a_refused_host_device_copy_gets_the_staging_hint_and_the_next_capture_works(cuda_backend):
    t = _persistent()
    with pytest.raises(CaptureError, match=r"torch refused a host-device copy during the capture of up \(Cannot copy"):
        cuda_backend.capture(lambda: _upload_forward(t), {}, name="up")
    graph = cuda_backend.capture(lambda: t["x"] + 1, {}, name="good")
    torch.testing.assert_close(graph.replay(), t["x"] + 1, rtol=0, atol=0)


def test_after_a_capture_cuda_invalidated_the_generators_draw_eagerly_and_in_graphs():
    sampler = torch.Generator(device="cuda").manual_seed(0)
    backend = get_backend("cuda", "cuda", generators=[sampler])
    t = _persistent()
    with pytest.raises(CaptureError, match="CUDA invalidated the capture of bad"):
        backend.capture(lambda: _sync_forward(t), {}, name="bad")
    torch.rand(4, device="cuda")  # the default generator: no "Offset increment outside graph capture"
    torch.rand(4, device="cuda", generator=sampler)  # the registered one too
    graph = backend.capture(lambda: torch.rand(4, device="cuda", generator=sampler), {}, name="draws")
    first = graph.replay().clone()
    assert not torch.equal(graph.replay(), first)  # the registered generator advances every replay
    backend.reset()


def test_the_reservation_is_taken_from_memory_the_cache_held():
    backend = get_backend("cuda", "cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
    del filler  # cached by the allocator, not free on the device
    budget = int(torch.cuda.mem_get_info()[0] + free * 0.5)  # more than is free, less than is cached
    try:
        assert backend.reserve(budget) > 0
    finally:
        backend.reset()
        torch.cuda.empty_cache()


def test_a_failed_first_capture_does_not_break_the_next_one_while_its_tensors_live(cuda_backend):
    """The failed forward's tensors (in the pool) stay alive through the error we keep; the next capture still works."""
    t = _persistent()

    def failing():
        t["scratch"] = torch.empty(1 << 20, device="cuda")  # a block of the pool, kept alive
        raise RuntimeError("model bug")

    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="model bug") as kept:
            cuda_backend.capture(failing, {}, name="bad")
        cuda_backend.warmup(lambda: t["x"] * 2, num_warmups=1)
        graph = cuda_backend.capture(lambda: t["x"] * 2, {}, name="good")  # not the use_count assert
        torch.testing.assert_close(graph.replay(), t["x"] * 2, rtol=0, atol=0)
    finally:
        gc.enable()
    del kept


def test_preflight_table_on_real_cuda_and_the_masked_scalar_store_captures(cuda_backend):
    t = _persistent()
    host = torch.ones(8, 64)
    for bad in (lambda: host.to("cuda"), lambda: t["x"].clone().copy_(host), lambda: torch.cuda.synchronize()):
        with pytest.raises(CaptureUnsafeError):
            check_capture_safe(bad, "cuda")
    pinned = torch.ones(8, 64).pin_memory()
    check_capture_safe(lambda: pinned.to("cuda", non_blocking=True), "cuda")  # capturable

    def store():
        y = t["x"].clone()
        y[y > 0] = 0.0  # masked_fill_ underneath: capturable
        return y

    cuda_backend.warmup(store, num_warmups=1)
    graph = cuda_backend.capture(store, {}, name="store")
    torch.testing.assert_close(graph.replay(), store(), rtol=0, atol=0)


def test_a_sync_the_table_misses_is_named_by_sync_debug(monkeypatch):
    import graphcap.backends.preflight as preflight

    monkeypatch.setattr(preflight, "_row_for", lambda func: None)  # as if .item() were not in the table
    monkeypatch.setattr(preflight, "_FUNCTIONS", {})
    x = torch.randn(4, device="cuda")
    backend = get_backend("cuda", "cuda")
    with pytest.raises(CaptureUnsafeError, match=r"aten\._local_scalar_dense\.default at .*synchroniz"):
        backend.warmup(lambda: x * x.sum().item(), num_warmups=1)


def test_sync_debug_mode_errors_on_a_host_sync_in_later_warmups():
    backend = get_backend("cuda", "cuda", sync_debug=True)
    x = torch.randn(4, device="cuda")
    calls = []

    def forward():
        calls.append(1)
        # The preflight run is clean; the plain warmup syncs, which sync-debug refuses.
        return x.sum().cpu() if len(calls) > 1 else x.sum()

    mode_before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(CaptureUnsafeError, match="synchroniz"):
        backend.warmup(forward, num_warmups=2)
    assert torch.cuda.get_sync_debug_mode() == mode_before


def test_a_compiled_forward_is_captured_compiled(cuda_backend):
    runs = []

    def counting(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend=counting)
    x = torch.randn(64, device="cuda")
    cuda_backend.warmup(lambda: compiled(x), num_warmups=1)
    before = len(runs)
    graph = cuda_backend.capture(lambda: compiled(x), {}, name="compiled")
    assert len(runs) == before + 1 and graph.uncompiled == ()  # capture ran the compiled code
    torch.testing.assert_close(graph.replay(), torch.relu(x) * 2 + 1)


@pytest.mark.skipif(not supports_input_liveness(), reason="CUDAGraph.capture_begin has no check_input_liveness")
def test_input_liveness_catches_a_freed_closure_tensor():
    backend = get_backend("cuda", "cuda", check_input_liveness=True)
    held = {"w": torch.randn(64, device="cuda")}
    backend.warmup(lambda: held["w"] * 2, num_warmups=1)
    graph = backend.capture(lambda: held["w"] * 2, {}, name="key")
    graph.replay()
    del held["w"]  # the graph still reads its address
    with pytest.raises(RuntimeError, match="dead tensor"):
        graph.replay()
    backend.reset()


def test_piecewise_capture_replays_pieces_on_one_pool_with_eager_attention_between():
    """full_and_piecewise on the GPU: one CUDAGraph per piece, `.item()` attention between them."""
    from graphcap.testing import Workload, make_config, make_manager

    config = make_config(
        {"device": "cuda", "model.attention": "per_request", "model.num_layers": 2},
        capture__mode="full_and_piecewise",
    )
    manager = make_manager(config)
    report = manager.capture()
    assert all(r.status == "captured" and r.verified for r in report.records)
    pieces = [manager.graphs[k] for k in manager.graphs if k.piecewise]
    assert pieces and all(g.num_pieces == 3 and g.graph_pool is manager.backend.pool for g in pieces)
    workload = Workload(config, seed=3, chunk=5)
    for _ in range(6):
        workload.add_random(24)
    for _ in range(30):
        batch = workload.next_batch()
        if batch.num_reqs == 0:
            break
        replayed = manager.execute(batch).clone()
        expected = manager.eager(batch)
        torch.testing.assert_close(replayed, expected, **config.checks.tolerance)
        workload.advance(expected)
    assert manager.stats.piecewise_replays > 0


def test_releasing_every_graph_then_capturing_again_on_one_backend_works(cuda_backend):
    """The allocator refuses a capture into a pool whose graphs were all released (use_count > 0)."""
    x = torch.randn(256, device="cuda")
    cuda_backend.warmup(lambda: x * 2, num_warmups=1)
    cuda_backend.capture(lambda: x * 2, {}, name="first").release()
    graph = cuda_backend.capture(lambda: x * 3, {}, name="second")
    torch.testing.assert_close(graph.replay(), x * 3, rtol=0, atol=0)


def test_two_capture_passes_with_a_passed_in_backend_capture_every_key():
    from graphcap import CaptureManager
    from graphcap.models import build_model
    from graphcap.testing import make_config

    config = make_config({"device": "cuda", "capture.sizes": [1, 2, 4]})
    manager = CaptureManager(build_model(config), config, backend=get_backend("cuda", "cuda"), progress=False)
    for _ in range(2):
        report = manager.capture()
        assert all(r.status == "captured" and r.verified for r in report.records)


def test_an_invalidated_capture_leaves_no_memory_behind_once_its_pool_is_released():
    """Whatever order this torch ends a failed capture in, its use of the pool is released exactly once."""
    backend = get_backend("cuda", "cuda")
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    backend.warmup(lambda: x * 2, num_warmups=1)
    backend.capture(lambda: x * 2, {}, name="good")  # the pool holds memory now
    with pytest.raises(CaptureError, match="CUDA invalidated"):
        backend.capture(lambda: _sync_forward({"x": x}), {}, name="bad")
    backend.reset()
    gc.collect()  # nothing of the failed forward's frames may hold a block of the pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == reserved  # a use left counted would keep the pool reserved


PINNING_CONFIG = {
    "device": "cuda",
    "model.attention": "per_request",
    "model.hidden_size": 256,
    "model.num_heads": 8,
    "model.num_kv_heads": 2,
    "model.num_layers": 2,
    "batching.max_num_tokens": 256,
    "batching.max_num_seqs": 64,
    "kv_cache.num_blocks": 512,
    "kv_cache.max_model_len": 64,
    "capture.sizes": [64, 128, 256],
}


def test_a_piecewise_graph_pins_no_memory_outside_its_pool():
    """Eager ops' arguments and results live in the pool as unowned aliases: allocated memory after the
    pass is about what the graphs' outputs need, not every key's attention tensors."""
    from graphcap.testing import make_config, make_manager

    config = make_config(PINNING_CONFIG, capture__mode="piecewise")
    manager = make_manager(config)
    manager.capture()  # the first pass creates what lives on (library workspaces of the capture stream)
    manager.reset()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    manager.capture()
    torch.cuda.synchronize()
    pinned = torch.cuda.memory_allocated() - allocated
    m = config.model
    attention_bytes = 256 * m.num_heads * m.head_dim * 4 * m.num_layers  # one key's attention outputs
    assert pinned < attention_bytes, f"{pinned} bytes allocated after capture"
