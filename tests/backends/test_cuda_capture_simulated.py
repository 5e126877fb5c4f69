"""The CUDA backend's capture calls on the CPU (tests/backends/simulated_cuda.py): the memory-budget
reservation follows the pool and covers small blocks, the cache is emptied before every capture, the
capture error mode, and the engine's generators registered before every capture begins.
tests/backends/test_cuda.py shows the same on a GPU."""

from __future__ import annotations

import pytest
import torch

from graphcap import CaptureManager, eager_op
from graphcap.backends import GraphPool, backend_for, get_backend
from graphcap.backends.cuda import SMALL_REQUEST, SMALL_SEGMENT, reservation_layout
from graphcap.errors import CaptureError
from graphcap.models import build_model
from graphcap.piecewise import running
from graphcap.testing import make_config
from tests.backends.fake_allocator import FakeCUDAGraph
from tests.backends.simulated_cuda import CUDA0, SimulatedCUDA

MiB = 1 << 20


class CUDAGenerator(torch.Generator):
    """Stands in for `torch.Generator("cuda")`, which a CPU-only torch cannot make."""

    @property
    def device(self) -> torch.device:
        return CUDA0


def _broken(x: torch.Tensor):
    def forward():
        x * 2
        raise RuntimeError("the forward broke")

    return forward


def test_the_reservation_splits_into_one_large_block_and_small_segments_allocated_together(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    took = backend.reserve(256 * MiB)
    large, segments = reservation_layout(256 * MiB)
    assert (large, segments) == (252 * MiB, 2) and large + segments * SMALL_SEGMENT == 256 * MiB
    handle = backend.pool.handle
    assert cuda.allocations == [(large, {handle})] + [(SMALL_REQUEST, {handle})] * 4  # all recorded to the pool
    assert took == 256 * MiB  # the 1 MiB blocks were alive together: two per 2 MiB small segment
    assert cuda.allocator.use_count[handle] == 1 and not cuda.allocator.recording  # the holder keeps the pool
    assert reservation_layout(64 << 30)[1] == 32 and reservation_layout(MiB) == (MiB, 0)


def test_a_failed_capture_moves_the_reservation_into_the_fresh_pool_and_frees_the_old_one(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    backend.reserve(256 * MiB)
    old, x = backend.pool.handle, torch.ones(4)
    with pytest.raises(RuntimeError, match="the forward broke"):
        backend.capture(_broken(x), {"x": x}, name="a")
    pool = backend.pool
    assert pool.handle != old and pool.reservation.handle == pool.handle and backend.reserved_bytes == 256 * MiB
    assert old not in cuda.allocator.use_count  # given back, and the pool freed: no memory left in it
    assert cuda.allocator.use_count[pool.handle] == 1  # the new holder
    backend.capture(lambda: x * 3, {"x": x}, name="b")
    assert cuda.begins()[-1][0] == pool.reservation.handle  # later captures carve from the reservation
    backend.reset()
    assert backend.reserved_bytes is None and not any(cuda.allocator.use_count.values())


def test_without_following_the_pool_the_reservation_is_stranded_in_the_old_handle(monkeypatch):
    # The canary: a rotation that only changes the handle leaves the budget's bytes where no capture goes.
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    backend.reserve(256 * MiB)

    def rotate(self) -> None:
        self.handle = self._new_handle()

    monkeypatch.setattr(GraphPool, "rotate", rotate)
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="the forward broke"):
        backend.capture(_broken(x), {"x": x}, name="a")
    assert backend.pool.reservation.handle != backend.pool.handle


def test_a_reservation_that_cannot_be_taken_again_warns_and_leaves_the_capture_error(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    backend.reserve(256 * MiB)
    x = torch.ones(4)

    def out_of_memory(handle, num_bytes):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")

    monkeypatch.setattr(backend.pool, "_reserve", out_of_memory)
    warned = pytest.warns(RuntimeWarning, match=r"reservation of 268435456 bytes could not be taken again .* out of")
    with warned, pytest.raises(RuntimeError, match="the forward broke"):
        backend.capture(_broken(x), {"x": x}, name="a")
    assert backend.reserved_bytes is None and not any(cuda.allocator.use_count.values())


def test_the_cache_is_emptied_before_every_capture_device_and_pinned_host(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    x = torch.ones(4)
    for scale in (2, 3, 4):
        backend.capture(lambda scale=scale: x * scale, {"x": x}, name=f"x{scale}")
    calls = cuda.allocator.calls
    begins = [i for i, call in enumerate(calls) if call[0:1] == ("capture_begin",)]
    assert len(begins) == 3
    for before, at in zip([-1, *begins], begins, strict=False):
        assert "empty_cache" in calls[before + 1 : at] and "host_empty_cache" in calls[before + 1 : at]


@pytest.mark.parametrize("mode", ["thread_local", "global", "relaxed"])
def test_capture_pieces_and_the_reservation_begin_with_the_chosen_error_mode(monkeypatch, mode):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend(**({} if mode == "thread_local" else {"capture_error_mode": mode}))
    backend.reserve(64 * MiB)
    x = torch.ones(4)
    backend.capture(lambda: x * 2, {"x": x}, name="full")
    _capture_pieces(backend, x)
    modes = [begin[1] for begin in cuda.begins()]
    assert len(modes) == 4 and set(modes) == {mode}  # the holder, the full graph and two pieces


def test_the_capture_error_mode_is_checked_and_the_config_chooses_it(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    with pytest.raises(ValueError, match=r"capture_error_mode must be one of thread_local, global, relaxed; got 'x'"):
        cuda.backend(capture_error_mode="x")
    with pytest.raises(ValueError, match=r"capture_error_mode must be one of .*; got 'local'"):
        get_backend("emulated", "cpu", capture_error_mode="local")
    config = make_config({"capture.capture_error_mode": "global"})
    backend, owned = backend_for("cuda", CUDA0, config)
    assert owned and backend.capture_error_mode == "global"
    assert backend_for("cuda", CUDA0, make_config())[0].capture_error_mode == "thread_local"


def test_the_engines_generators_are_registered_on_every_graph_and_piece_before_capture_begins(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    sampler, noise = CUDAGenerator(), CUDAGenerator()
    backend = cuda.backend(generators=[sampler])
    backend.add_generators((noise, sampler))  # a second manager on the backend: one registration each
    assert backend.generators == (sampler, noise)
    x = torch.ones(4)
    backend.capture(lambda: x * 2, {"x": x}, name="full")
    _capture_pieces(backend, x)
    graph_calls = [c for c in cuda.allocator.calls if c[0:1] in (("register_generator_state",), ("capture_begin",))]
    expected = [("register_generator_state", sampler), ("register_generator_state", noise)]
    assert [c for c in graph_calls if c[0] == "register_generator_state"] == expected * 3
    for i in range(3):  # the full graph, then each piece: both generators, then capture_begin
        assert graph_calls[3 * i : 3 * i + 2] == expected and graph_calls[3 * i + 2][0] == "capture_begin"


def test_generators_are_refused_naming_the_entry_and_the_fix(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    with pytest.raises(TypeError, match=r"generators\[1\] must be a torch.Generator; got int"):
        cuda.backend(generators=[CUDAGenerator(), 1])
    with pytest.raises(TypeError, match=r"generators must be a list of torch.Generator .* wrap a single generator"):
        cuda.backend(generators=CUDAGenerator())
    with pytest.raises(ValueError, match=r"generators\[0\] is a generator of cpu, but the graphs run on cuda:0"):
        cuda.backend(generators=[torch.Generator()])
    monkeypatch.delattr(FakeCUDAGraph, "register_generator_state")  # a torch without it
    with pytest.raises(CaptureError, match=r"generators= needs CUDAGraph.register_generator_state, which torch"):
        cuda.backend(generators=[CUDAGenerator()])
    assert cuda.backend().generators == ()  # no generators: nothing to register, nothing refused


def test_a_manager_gives_its_generators_to_the_backend_and_checks_them_first():
    config = make_config({"capture.sizes": [1, 2]})
    model = build_model(config)
    sampler = torch.Generator()
    manager = CaptureManager(model, config, progress=False, generators=[sampler])
    assert manager.backend.generators == (sampler,)
    with pytest.raises(TypeError, match=r"generators\[0\] must be a torch.Generator; got str"):
        CaptureManager(model, config, progress=False, generators=["g"])
    with pytest.raises(ValueError, match=r"generators\[0\] is a generator of cuda:0, but the graphs run on cpu"):
        CaptureManager(model, config, progress=False, generators=[CUDAGenerator()])


def _capture_pieces(backend, x: torch.Tensor) -> None:
    """A piecewise capture of two pieces around one eager op (no kernels: the CPU runs the forward)."""

    @eager_op
    def double(t):
        return t * 2

    metadata = {"query_start_loc": torch.zeros(2), "seq_lens": torch.zeros(1), "block_table": torch.zeros(1, 1)}

    def forward(session):
        from types import SimpleNamespace

        inputs = SimpleNamespace(**metadata, limits=SimpleNamespace(extras=()))
        with running(inputs, "piecewise", session):
            return double(x + 1) + 1

    backend.capture_pieces(forward, {"x": x}, name="pieces")


def test_a_reservation_the_device_cannot_hold_leaves_no_use_of_the_pool_behind(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    handle = backend.pool.handle
    real_empty = torch.empty

    def out_of_memory(*size, dtype=None, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 63.00 GiB")
        return real_empty(*size, dtype=dtype, device=device, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            backend.reserve(64 << 30)
    assert backend.reserved_bytes is None and not cuda.allocator.recording
    assert handle not in cuda.allocator.use_count and backend.pool.handle != handle  # the holder's use went back
    x = torch.ones(4)
    backend.capture(lambda: x * 2, {"x": x}, name="after")  # no use_count > 0 assertion
