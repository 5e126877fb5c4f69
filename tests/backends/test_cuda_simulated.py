"""CUDA-backend rules shown on the CPU, with the CUDA calls simulated: the sync-debug mode in eager-op
bodies, a torch without `check_input_liveness`, a pool whose last graph was released (the allocator's
`use_count > 0` assert), a piece whose `capture_end` fails, what a piecewise graph keeps alive,
tensor-subclass inputs without storage, and the memory budget reserved in the pool.
tests/backends/test_cuda.py shows the same on a GPU."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from graphcap import CaptureManager, eager_op
from graphcap.backends import EmulatedBackend, GraphPool
from graphcap.backends.cuda import CUDAGraphBackend, supports_input_liveness
from graphcap.backends.cuda_pieces import CUDAPieceSession, release_pool_tensors
from graphcap.backends.graph import record_input_ptrs
from graphcap.backends.preflight import preflight
from graphcap.capture.recorder import WarmupSession
from graphcap.errors import CaptureError
from graphcap.models import build_model
from graphcap.piecewise import running
from graphcap.testing import make_config
from tests.backends.fake_allocator import FakeAllocator, FakeCUDAGraph, InternalAssert
from tests.backends.simulated_cuda import SimulatedCUDA

CUDA0 = torch.device("cuda", 0)


def test_eager_op_bodies_run_with_sync_debug_off_inside_a_preflight_that_turned_it_on(monkeypatch):
    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(
        torch.cuda, "set_sync_debug_mode", lambda value: mode.update(now={"error": 2}.get(value, value))
    )
    seen = []

    @eager_op
    def attention(x):
        seen.append(mode["now"])  # an .item() here would fail under mode 2 ("error")
        return x * 2

    with preflight("cpu", sync_debug=True):
        assert mode["now"] == 2
        with running(None, "piecewise_warmup", WarmupSession()):  # as a capture pass runs a piecewise warmup
            attention(torch.ones(2))
        assert mode["now"] == 2  # restored for the code after the eager op
    assert seen == [0] and mode["now"] == 0


def _capture_begin_2_11(self, pool=None, capture_error_mode="global"):
    raise AssertionError("not called")


def _capture_begin_2_13(self, pool=None, capture_error_mode="global", check_input_liveness=False):
    raise AssertionError("not called")


def test_check_input_liveness_is_refused_on_a_torch_whose_capture_begin_lacks_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", _capture_begin_2_11)
    assert not supports_input_liveness()
    with pytest.raises(CaptureError, match=r"check_input_liveness=True needs torch 2\.13 or later .* leave it off"):
        CUDAGraphBackend(CUDA0, check_input_liveness=True)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", _capture_begin_2_13)
    assert supports_input_liveness()


class FakeCUDABackend(EmulatedBackend):
    """The emulated backend with the CUDA allocator's pool accounting: a capture takes a use of the
    pool's handle (asserting as PyTorch does), a release gives it back."""

    checks_in_capture = False  # as on CUDA: a capture checks nothing, the preflight runs before it

    def __init__(self, allocator: FakeAllocator) -> None:
        self.allocator = allocator
        super().__init__("cpu")

    def _new_pool(self) -> GraphPool:
        handles = itertools.count(1)
        return GraphPool(self.device, lambda: (0, next(handles)), empty_cache=self.allocator.empty_cache)

    def _capture(self, fn, *, name, input_ptrs):
        handle = self.pool.handle
        self.allocator.begin(0, handle)
        try:
            graph = super()._capture(fn, name=name, input_ptrs=input_ptrs)
        except BaseException:
            self.allocator.release(0, handle)
            raise
        finally:
            self.allocator.end(0, handle)
        release = graph._release

        def _release() -> None:
            release()
            self.allocator.release(0, handle)

        graph._release = _release
        return graph


def test_capturing_again_after_releasing_the_last_graph_of_the_pool_goes_to_a_fresh_handle():
    backend = FakeCUDABackend(FakeAllocator())
    x = torch.arange(4.0)
    first = backend.capture(lambda: x * 2, {"x": x}, name="a")
    handle = backend.pool.handle
    first.release()  # the handle's use count is 0 now: the pool rotates and its memory is given back
    assert handle not in backend.allocator.use_count and backend.pool.handle != handle
    again = backend.capture(lambda: x * 3, {"x": x}, name="b")  # not the use_count > 0 assert
    torch.testing.assert_close(again.replay(), x * 3)
    kept = backend.capture(lambda: x + 1, {"x": x}, name="c")
    again.release()  # another graph still lives in the handle: no rotation
    assert backend.pool.handle == kept.graph_pool.handle and backend.pool.num_live() == 1


def test_without_rotation_the_next_capture_hits_the_allocators_assert(monkeypatch):
    # The canary: PyTorch refuses a capture into a handle whose graphs were all released (and not yet
    # freed by empty_cache).
    monkeypatch.setattr(GraphPool, "rotate", lambda self: None)
    monkeypatch.setattr(FakeAllocator, "empty_cache", lambda self: None)
    backend = FakeCUDABackend(FakeAllocator())
    x = torch.arange(4.0)
    backend.capture(lambda: x * 2, {"x": x}, name="a").release()
    with pytest.raises(InternalAssert, match="use_count > 0"):
        backend.capture(lambda: x * 3, {"x": x}, name="b")


def test_a_second_capture_pass_with_a_passed_in_backend_captures_every_key_again():
    config = make_config({"capture.sizes": [1, 2, 4]})
    backend = FakeCUDABackend(FakeAllocator())
    manager = CaptureManager(build_model(config), config, backend=backend, progress=False)
    for _ in range(2):  # the second pass releases every graph of the first one, in the same backend
        report = manager.capture()
        assert [r.status for r in report.records] == ["captured"] * len(report.records)


class _Stream:
    def wait_stream(self, other) -> None:
        pass


def _simulated_piece_session(monkeypatch, allocator: FakeAllocator, pool_tensors: list) -> CUDAPieceSession:
    """A CUDAPieceSession on the CPU: CUDAGraph, streams and the allocator snapshot simulated."""
    handles = itertools.count(1)
    pool = GraphPool(CUDA0, lambda: (0, next(handles)), _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: SimpleNamespace(__enter__=None))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeCUDAGraph(allocator))
    segments = lambda: [  # noqa: E731
        {"device": 0, "address": s.data_ptr(), "total_size": s.nbytes(), "segment_pool_id": pool.handle}
        for s in (t.untyped_storage() for t in pool_tensors)
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", segments)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: _NullContext())
    backend = SimpleNamespace(
        device=CUDA0, pool=pool, synchronize=lambda: None, generators=(), capture_error_mode="thread_local"
    )
    backend.restored = []  # restore_generators calls: the error each was given
    backend.restore_generators = lambda error=None: backend.restored.append(error)
    return CUDAPieceSession(backend, "piecewise(tokens=4)")


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def test_a_piece_whose_capture_end_fails_is_discarded_at_once(monkeypatch):
    allocator = FakeAllocator().install(monkeypatch)
    session = _simulated_piece_session(monkeypatch, allocator, [])
    handle = session.backend.pool.handle
    session.begin_piece()
    session._graph.invalidated = True  # CUDA invalidated the capture of this piece
    with pytest.raises(RuntimeError, match="CUDA error") as caught:
        session.end_piece()
    assert session.backend.restored == [caught.value]  # the generators were taken out of capture mode
    assert handle not in allocator.recording  # the allocator does not stay recording to the pool
    assert allocator.use_count.get(handle, 0) == 0  # the piece's use released once (empty_cache freed it)
    assert allocator.calls.count(("release", handle)) == 1
    session.abort()  # what the backend does next: nothing is released twice
    assert allocator.calls.count(("release", handle)) == 1


def test_a_cuda_piecewise_graph_keeps_no_pool_tensor_alive_and_never_nan_fills_its_output(monkeypatch):
    allocator = FakeAllocator().install(monkeypatch)
    made: list[torch.Tensor] = []  # tensors "allocated in the pool" by the pieces
    session = _simulated_piece_session(monkeypatch, allocator, made)
    weight = torch.ones(4)  # a parameter: outside the pool, owned by the model

    @eager_op
    def attention(q, w, out=None):
        return torch.mul(q, w, out=out)

    metadata = {"query_start_loc": torch.zeros(2), "seq_lens": torch.zeros(1), "block_table": torch.zeros(1, 1)}
    inputs = SimpleNamespace(**metadata, limits=SimpleNamespace(extras=()))
    with running(inputs, "piecewise", session):
        session.begin_piece()
        q = torch.arange(4.0)
        made.append(q)
        attended = attention(q, weight)
        made.append(attended)  # the static result, allocated inside the next piece
        out = attended + 1
        made.append(out)
        graph = session.finish(out, {})
    (call,) = graph.calls
    uses = torch._C._storage_Use_Count
    q_storage = q.untyped_storage()
    assert call.args[0] is not q and call.args[0].data_ptr() == q.data_ptr()
    assert call.args[1] is weight  # not in the pool: kept owned
    assert call.out.data_ptr() == attended.data_ptr()
    before = uses(q_storage._cdata)
    del call.args  # the alias never counted as an owner of q's memory
    assert uses(q_storage._cdata) == before
    assert graph.owned == [True] and not graph.invalidates
    with torch.inference_mode():
        graph.leaves[0].copy_(torch.full((4,), 5.0))
    graph.invalidate_output()  # what another graph's replay does
    torch.testing.assert_close(graph.leaves[0], torch.full((4,), 5.0))


def test_release_pool_tensors_keeps_tensors_outside_the_pool_owned():
    inside, outside = torch.arange(6.0), torch.ones(3)
    call = SimpleNamespace(args=(inside[2:5], [outside]), kwargs={"k": inside}, out=torch.zeros(3))
    in_pool = lambda t: t.untyped_storage().data_ptr() == inside.untyped_storage().data_ptr()  # noqa: E731
    release_pool_tensors([call], in_pool)
    view, (kept,) = call.args
    assert kept is outside and view.data_ptr() == inside[2:].data_ptr() and view.stride() == (1,)
    assert call.kwargs["k"] is not inside and torch.equal(call.kwargs["k"], inside)
    inside.add_(1)  # same memory
    torch.testing.assert_close(view, inside[2:5])


class _Wrapper(torch.Tensor):
    """A tensor subclass without storage of its own, like an FP8 weight wrapper or a DTensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a wrapper")


def test_a_static_input_without_storage_is_named_with_what_to_register_instead():
    weight = _Wrapper(torch.ones(4, 4))
    with pytest.raises(
        CaptureError, match=r"static input 'layers.0.w' is a _Wrapper without storage .* register those"
    ):
        record_input_ptrs({"layers.0.w": weight})


def test_the_budget_reservation_allocates_in_the_pool_once_and_holds_it_until_reset(monkeypatch):
    cuda = SimulatedCUDA(monkeypatch)
    backend = cuda.backend()
    pool, handle = backend.pool, backend.pool.handle
    took = backend.reserve(256 << 20)
    assert took == 256 << 20 and backend.reserved_bytes == 256 << 20
    assert {handle} == set.union(*(recording for _, recording in cuda.allocations))  # allocated while recording
    assert cuda.allocator.use_count[handle] == 1 and not cuda.allocator.recording  # the reservation holds the pool
    assert backend.reserve(128 << 20) == 0 and len(cuda.graphs) == 1  # held already: nothing more
    pool.drop(pool.hold())  # a graph of the pool captured, then released (a min_speedup or failed key)
    assert pool.handle == handle, "the pool kept its handle: later captures still use the reserved memory"
    backend.reset()
    assert handle not in cuda.allocator.use_count and pool.handle != handle  # given back with the graphs, freed
    assert backend.reserved_bytes is None
