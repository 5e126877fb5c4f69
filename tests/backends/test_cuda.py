"""The CUDA backend on a real GPU: replay == eager, one shared pool, address checks, the
unsafe-op preflight, sync-debug restored, clean failure. Skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from graphcap.backends import CaptureError, CaptureUnsafeError, StaticInputMovedError, get_backend
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
    assert graph.output.data_ptr() == graph.replay().data_ptr()


def test_graphs_share_one_pool_and_report_memory(cuda_backend):
    t = _persistent()
    graphs = []
    for rows in (8, 4, 2):  # largest first, as the manager captures
        forward = lambda r=rows: F.linear(t["x"][:r], t["w"])  # noqa: E731
        cuda_backend.warmup(forward, num_warmups=1)
        graphs.append(cuda_backend.capture(forward, {}, name=f"k{rows}"))
    assert len({repr(g.pool) for g in graphs}) == 1
    assert all(g.memory_bytes >= 0 for g in graphs)
    assert cuda_backend.memory_in_use() > 0 and cuda_backend.free_memory() > 0
    cuda_backend.reset()
    assert cuda_backend.graphs == ()
    with pytest.raises(CaptureError, match="released"):
        graphs[0].replay()


def test_replaced_input_is_refused(cuda_backend):
    t = _persistent()
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


def test_unsafe_op_during_capture_leaves_nothing_and_cuda_usable(cuda_backend):
    t = _persistent()
    stream_before = torch.cuda.current_stream()
    with pytest.raises(CaptureUnsafeError, match=r"aten\.nonzero"):
        cuda_backend.capture(lambda: _nonzero_forward(t), {}, name="bad")
    assert cuda_backend.graphs == () and torch.cuda.current_stream() == stream_before
    assert not torch.cuda.is_current_stream_capturing()
    graph = cuda_backend.capture(lambda: t["x"] + 1, {}, name="good")  # CUDA still works
    torch.testing.assert_close(graph.replay(), t["x"] + 1, rtol=0, atol=0)


def test_sync_debug_mode_errors_on_a_host_sync_in_later_warmups():
    backend = get_backend("cuda", "cuda", sync_debug=True)
    x = torch.randn(4, device="cuda")
    calls = []

    def forward():
        calls.append(1)
        # The first (checked) warmup is clean; the second syncs, which sync-debug refuses.
        return x.sum().cpu() if len(calls) > 1 else x.sum()

    mode_before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(RuntimeError, match="synchroniz"):
        backend.warmup(forward, num_warmups=2)
    assert torch.cuda.get_sync_debug_mode() == mode_before
