"""One memory pool per backend: what an output's validity means, sharing on request, rotation
after a failed capture, and the emulated backend failing where CUDA's pool reuse would."""

from __future__ import annotations

import itertools

import pytest
import torch

from graphcap.backends import CaptureUnsafeError, EmulatedBackend, GraphPool, get_backend
from graphcap.backends.cuda import CUDACapturedGraph
from graphcap.backends.pool import invalidate, unowned_alias


def _two_graphs(backend, x):
    big = backend.capture(lambda: x * 2, {"x": x}, name="big")  # captured first, as largest-first does
    small = backend.capture(lambda: x[:2] + 1, {"x": x}, name="small")
    return big, small


def test_an_output_is_invalid_once_another_graph_of_the_pool_replays(emulated):
    x = torch.arange(4.0)
    big, small = _two_graphs(emulated, x)
    kept = small.replay()  # a caller that keeps the view past the next step...
    torch.testing.assert_close(kept, torch.tensor([1.0, 2.0]))
    big.replay()
    assert kept.isnan().all()  # ...reads what a reused CUDA pool block would hold
    torch.testing.assert_close(small.replay(), torch.tensor([1.0, 2.0]))  # its own replay rewrites it
    torch.testing.assert_close(small.replay(), torch.tensor([1.0, 2.0]))  # a graph never invalidates itself


def test_integer_and_boolean_outputs_read_as_garbage_too():
    for dtype, expected in ((torch.int32, torch.iinfo(torch.int32).min), (torch.int64, torch.iinfo(torch.int64).min)):
        out = torch.arange(3, dtype=dtype)
        invalidate(out)
        assert (out == expected).all()
    flags = torch.zeros(3, dtype=torch.bool)
    invalidate(flags)
    assert flags.all()


def test_an_output_that_views_an_external_is_never_invalidated(emulated):
    # A forward that returns a slice of a buffer it writes: on CUDA that memory is not the pool's.
    x, buffer = torch.arange(4.0), torch.zeros(4)

    def forward():
        buffer.copy_(x * 3)
        return buffer[:2]

    view = emulated.capture(forward, {"x": x}, name="view")
    other = emulated.capture(lambda: x + 1, {"x": x}, name="other")
    kept = view.replay()
    other.replay()
    torch.testing.assert_close(kept, torch.tensor([0.0, 3.0]))
    torch.testing.assert_close(buffer, torch.tensor([0.0, 3.0, 6.0, 9.0]))


def test_each_backend_has_its_own_pool_unless_sharing_is_asked_for():
    x = torch.arange(4.0)
    target, draft = EmulatedBackend("cpu"), EmulatedBackend("cpu")
    assert target.pool is not draft.pool
    target_graph = target.capture(lambda: x * 2, {"x": x}, name="target")
    draft_graph = draft.capture(lambda: x + 1, {"x": x}, name="draft")
    kept = target_graph.replay()
    draft_graph.replay()  # another backend's pool: the target's output stays valid
    torch.testing.assert_close(kept, x * 2)

    shared = get_backend("emulated", "cpu", share_pool_with=target)
    assert shared.pool is target.pool
    shared_graph = shared.capture(lambda: x - 1, {"x": x}, name="shared")
    kept = target_graph.replay()
    shared_graph.replay()  # one pool: the draft model's step clobbers the target's output
    assert kept.isnan().all()


def test_sharing_a_pool_across_kinds_or_devices_is_refused():
    cpu = EmulatedBackend("cpu")
    with pytest.raises(ValueError, match=r"share_pool_with: a emulated backend on meta cannot share the pool"):
        get_backend("emulated", "meta", share_pool_with=cpu)
    with pytest.raises(TypeError, match="share_pool_with must be a graph backend; got str"):
        get_backend("emulated", "cpu", share_pool_with="cpu")


def test_a_failed_capture_moves_later_captures_to_a_fresh_pool(emulated):
    x = torch.arange(4.0)
    good = emulated.capture(lambda: x * 2, {"x": x}, name="good")
    rotations = emulated.pool.num_rotations
    with pytest.raises(CaptureUnsafeError):
        emulated.capture(lambda: torch.nonzero(x), {"x": x}, name="bad")
    assert emulated.pool.num_rotations == rotations + 1
    torch.testing.assert_close(good.replay(), x * 2)  # graphs captured before keep working
    emulated.reset()
    assert emulated.pool.num_rotations == rotations + 2  # a reset starts a fresh pool too


def test_rotation_hands_out_a_fresh_handle_and_graphs_keep_theirs():
    handles = itertools.count()
    pool = GraphPool(torch.device("cpu"), new_handle=lambda: ("pool", next(handles)))
    first = pool.handle
    graph = CUDACapturedGraph(
        name="k",
        output=torch.zeros(1),
        input_ptrs={},
        memory_bytes=0,
        graph_pool=pool,
        graph=_Graph(),
        pool_handle=first,
    )
    pool.rotate()
    assert pool.handle == ("pool", 1) != first
    assert graph.pool == first
    graph.release()
    assert graph.pool == first and graph.output is None  # no AttributeError after release
    assert graph.graph is None and _Graph.resets == 1


class _Graph:
    """Stands in for torch.cuda.CUDAGraph where only reset() is called."""

    resets = 0

    def reset(self) -> None:
        type(self).resets += 1


def test_unowned_alias_reads_and_writes_the_same_memory_without_owning_it():
    owner = torch.arange(12.0).reshape(3, 4)
    view = owner[1:, 1:3]
    storage = owner.untyped_storage()
    uses = torch._C._storage_Use_Count(storage._cdata)
    alias = unowned_alias(view)
    assert torch._C._storage_Use_Count(storage._cdata) == uses  # the alias does not own the memory
    control = view.detach()
    assert torch._C._storage_Use_Count(storage._cdata) == uses + 1  # a tensor that does
    assert alias.data_ptr() == view.data_ptr() and alias.stride() == view.stride()
    assert alias.is_inference() and not control.is_inference()  # like the graph output it stands for
    owner.add_(1)
    torch.testing.assert_close(alias, view)
