"""The emulated backend behaves like a CUDA graph: replay == eager bitwise, frozen control
flow, one static output overwritten in place, captured storages (a swapped parameter reads
stale), address checks, no Python forward on replay, nothing kept alive but externals and the
output, clean failure. Output invalidation across a pool: tests/backends/test_pool.py."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from graphcap.backends import (
    BACKEND_NAMES,
    CaptureError,
    CaptureUnsafeError,
    EmulatedBackend,
    StaticInputMovedError,
    get_backend,
)
from graphcap.backends.bindings import native_binding


@dataclass
class Case:
    """A forward over persistent tensors: `inputs` are refreshed in place between replays,
    `state` are tensors the forward writes in place (compared after replay and eager)."""

    forward: Callable[[], torch.Tensor]
    inputs: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _linear_matmul() -> Case:
    shapes = [(4, 16), (32, 16), (32,), (32, 8)]
    x, w, b, w2 = (torch.randn(*s, generator=_gen(i)) for i, s in enumerate(shapes))
    return Case(lambda: F.linear(x, w, b) @ w2 + torch.matmul(x, w.t()).sum(), {"x": x})


def _softmax() -> Case:
    x = torch.randn(4, 16, generator=_gen(0))
    return Case(lambda: torch.softmax(x * 3.0, dim=-1) + F.log_softmax(x, dim=0), {"x": x})


def _views_and_slicing() -> Case:
    x = torch.randn(4, 8, generator=_gen(0))

    def forward():
        v = x.view(2, 2, 8)[:, 1, 2:6].transpose(0, 1).reshape(8)
        return v + x[1:3].flatten()[::2] + x.narrow(1, 0, 1).expand(4, 2).reshape(8) + x[-1, :8]

    return Case(forward, {"x": x})


def _inplace_on_persistent() -> Case:
    x, acc = torch.randn(4, 8, generator=_gen(0)), torch.zeros(8)

    def forward():
        acc.add_(x.sum(0))
        acc.mul_(0.5)
        acc[2:4].fill_(1.0)  # through a view
        return acc * 2

    return Case(forward, {"x": x}, {"acc": acc})


def _cache_writes() -> Case:
    x, slots = torch.randn(4, 8, generator=_gen(0)), torch.tensor([3, 0, 7, 5])
    cache, w = torch.zeros(2, 10, 8), torch.randn(8, 8, generator=_gen(1))

    def forward():
        layer = cache[1]  # a view of the cache
        layer.index_copy_(0, slots, x @ w)
        cache[0].index_put_((slots,), x, accumulate=True)
        cache[0][slots[:2]] = x[:2] * 2  # __setitem__ with an integer index
        return layer.index_select(0, slots).sum(-1) + cache[0].sum(-1)[:4]

    return Case(forward, {"x": x, "slots": slots}, {"cache": cache})


def _factories() -> Case:
    x = torch.randn(6, generator=_gen(0))

    def forward():
        return (
            torch.arange(6)
            + torch.zeros(6)
            + torch.full((6,), 2.5)
            + torch.ones_like(x)
            + x.new_zeros(6)
            + torch.arange(0, 12, 2, dtype=torch.float32) * x
            + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # a constant made at capture
        )

    return Case(forward, {"x": x})


def _dtype_casts() -> Case:
    x = torch.randn(4, 8, generator=_gen(0)) * 10

    def forward():
        rounded = x.half().float() + x.bfloat16().float()
        return (rounded + x.to(torch.int32).to(torch.float32)).double()

    return Case(forward, {"x": x})


def _multi_output() -> Case:
    x = torch.randn(4, 8, generator=_gen(0))
    out = torch.empty(4, 8)

    def forward():
        values, indices = torch.max(x, dim=1)
        first, second = x.split(2)
        top = x.topk(3, dim=-1)
        torch.mul(x, 2, out=out)  # a persistent out= tensor
        parts = [values, indices.float(), first.sum(0), second.sum(0), top.values.flatten()]
        return torch.cat([*parts, top.indices.float().flatten(), out.flatten()])

    return Case(forward, {"x": x}, {"out": out})


CASES = {
    "linear_matmul": _linear_matmul,
    "softmax": _softmax,
    "views_and_slicing": _views_and_slicing,
    "inplace_on_persistent": _inplace_on_persistent,
    "cache_writes": _cache_writes,
    "factories": _factories,
    "dtype_casts": _dtype_casts,
    "multi_output": _multi_output,
}


def _refresh(case: Case, seed: int) -> None:
    for tensor in case.inputs.values():
        if tensor.is_floating_point():
            tensor.copy_(torch.randn(tensor.shape, generator=_gen(seed)))  # in place: same address
        else:
            tensor.copy_(tensor.flip(0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_equals_eager_bitwise(emulated, name):
    case = CASES[name]()
    emulated.warmup(case.forward, num_warmups=1)
    graph = emulated.capture(case.forward, case.inputs, name=name)
    for seed in (1, 2):
        _refresh(case, seed)
        before = {k: v.clone() for k, v in case.state.items()}
        replayed = graph.replay().clone()
        after_replay = {k: v.clone() for k, v in case.state.items()}
        for k, v in case.state.items():
            v.copy_(before[k])
        with torch.inference_mode():
            expected = case.forward()
        torch.testing.assert_close(replayed, expected, rtol=0, atol=0)
        for k, v in case.state.items():
            torch.testing.assert_close(after_replay[k], v, rtol=0, atol=0, msg=f"state {k}")


def test_python_control_flow_is_frozen_at_capture(emulated):
    x = torch.randn(4)

    class Model:
        use_square = False

        def forward(self):
            return x * x if self.use_square else x + 1

    model = Model()
    graph = emulated.capture(model.forward, {"x": x}, name="key")
    model.use_square = True
    torch.testing.assert_close(graph.replay(), x + 1, rtol=0, atol=0)  # the captured branch
    torch.testing.assert_close(model.forward(), x * x, rtol=0, atol=0)  # eager follows the flip


def test_replays_overwrite_one_static_output(emulated):
    x = torch.randn(4, 8)
    graph = emulated.capture(lambda: torch.tanh(x) * 2, {"x": x}, name="key")
    first = graph.replay()
    pointer = first.data_ptr()
    x.copy_(torch.randn(4, 8))
    second = graph.replay()
    assert first is second is graph.output and second.data_ptr() == pointer
    torch.testing.assert_close(first, torch.tanh(x) * 2, rtol=0, atol=0)  # the latest inputs


def test_a_storage_swapped_after_capture_replays_the_stale_data_as_cuda_would(emulated):
    # A CUDA graph holds the address it captured; `param.data = new` moves the parameter to new
    # memory and the graph keeps reading the old. The tape holds the captured storage the same way.
    layer = torch.nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(4))
    graph = emulated.capture(lambda: layer(x), {"x": x, "weight": layer.weight}, name="key")
    old_weight = layer.weight.data
    layer.weight.data = torch.full((4, 4), 2.0)  # the swap (checks off: no address check here)
    torch.testing.assert_close(graph.replay(), x, rtol=0, atol=0)  # still the identity: stale
    with torch.inference_mode():
        assert not torch.equal(layer(x), x)  # eager reads the new weight
    with pytest.raises(StaticInputMovedError, match="'weight'"):
        graph.check_addresses({"x": x, "weight": layer.weight})  # what the address check catches
    with torch.no_grad():
        old_weight.mul_(3)  # writes to the captured memory itself reach the replay
    torch.testing.assert_close(graph.replay(), 3 * x, rtol=0, atol=0)


def test_writes_to_externals_through_the_tape_reach_the_original_tensors(emulated):
    cache, x = torch.zeros(4), torch.arange(4.0)
    graph = emulated.capture(lambda: cache.add_(x).sum(), {"x": x}, name="key")
    cache.zero_()
    graph.replay()
    torch.testing.assert_close(cache, x, rtol=0, atol=0)


def test_the_output_is_an_inference_tensor_as_on_cuda(emulated):
    x = torch.randn(4)
    out = emulated.capture(lambda: x * 2, {"x": x}, name="key").replay()
    assert out.is_inference()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        out.add_(1)


def test_replaced_persistent_input_is_refused(emulated):
    x = torch.randn(4)
    graph = emulated.capture(lambda: x * 2, {"x": x}, name="GraphKey(4)")
    graph.check_addresses({"x": x})  # same tensor: fine
    replacement = torch.randn(4)
    with pytest.raises(StaticInputMovedError, match=r"'x' of graph GraphKey\(4\) moved") as caught:
        graph.check_addresses({"x": replacement})
    message = str(caught.value)
    assert f"{x.data_ptr():#x}" in message and f"{replacement.data_ptr():#x}" in message
    assert "write into it in place with copy_() or capture again" in message
    assert (caught.value.input_name, caught.value.current_ptr) == ("x", replacement.data_ptr())
    with pytest.raises(StaticInputMovedError, match=r"'x' .* is missing"):
        graph.check_addresses({})
    with pytest.raises(StaticInputMovedError, match=r"'y' .* was not given at capture"):
        graph.check_addresses({"x": x, "y": replacement})


def test_input_moved_during_capture_fails_the_capture(emulated):
    x = torch.zeros(4)

    def forward():
        x.resize_(1 << 16)  # the forward grows the buffer: it is reallocated elsewhere
        return x[:4] + 1

    with pytest.raises(StaticInputMovedError, match="'x'"):
        emulated.capture(forward, {"x": x}, name="key")
    assert emulated.graphs == () and emulated.memory_in_use() == 0


def test_replay_never_runs_the_python_forward(emulated):
    x = torch.randn(4)
    calls = []

    def forward():
        calls.append(1)
        return x.exp()

    graph = emulated.capture(forward, {"x": x}, name="key")
    for _ in range(3):
        graph.replay()
    assert len(calls) == 1 and graph.num_replays == 3


def test_replay_after_release_raises(emulated):
    x = torch.randn(4)
    graph = emulated.capture(lambda: x * 2, {"x": x}, name="key")
    graph.release()
    assert graph.output is None and emulated.graphs == () and emulated.memory_in_use() == 0
    with pytest.raises(CaptureError, match="released; capture it again"):
        graph.replay()
    graph.release()  # idempotent


def _raises_value_error():
    raise ValueError("bad forward")


def _unsafe_forward():
    return torch.nonzero(torch.ones(3))


@pytest.mark.parametrize(
    ("forward", "error"),
    [
        (_raises_value_error, ValueError),
        (_unsafe_forward, CaptureUnsafeError),
        (lambda: 3, CaptureError),
    ],
    ids=["fn_raises", "unsafe_op", "not_a_tensor"],
)
def test_failed_capture_leaves_nothing_registered(emulated, forward, error):
    x = torch.randn(4, 8)
    kept = emulated.capture(lambda: x @ x.t(), {"x": x}, name="kept")
    memory = emulated.memory_in_use()
    with pytest.raises(error):
        emulated.capture(forward, {"x": x}, name="failing")
    assert emulated.graphs == (kept,) and emulated.memory_in_use() == memory > 0


def test_no_intermediate_outlives_capture(emulated):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    refs = []

    def forward():
        h = x @ w
        g = torch.relu(h)
        values, unused_indices = torch.max(g, dim=0)
        refs.extend(weakref.ref(t) for t in (h, g, values, unused_indices))
        return torch.cat([h, g]).sum(0) + values

    graph = emulated.capture(forward, {"x": x}, name="key")
    graph.replay()
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    expected = (x @ w).relu()
    expected = torch.cat([x @ w, expected]).sum(0) + expected.max(0).values
    torch.testing.assert_close(graph.output, expected)


def test_memory_bytes_is_peak_of_live_slots_plus_output(emulated):
    x = torch.randn(32)  # 128 bytes

    def forward():
        a = x * 2  # live: a
        b = a + 1  # live: a, b (a's last use) -> peak 256
        return b * 3  # live: b, result -> 256; the result is copied into the output

    graph = emulated.capture(forward, {"x": x}, name="key")
    assert graph.memory_bytes == 256 + 128  # peak + the static output held between replays
    assert emulated.memory_in_use() == graph.memory_bytes


def test_captures_do_not_nest(emulated):
    x = torch.randn(4)

    def forward():
        emulated.capture(lambda: x + 1, {}, name="inner")
        return x * 2

    with pytest.raises(CaptureError, match="captures do not nest"):
        emulated.capture(forward, {"x": x}, name="outer")
    assert emulated.graphs == ()


def test_warmup_runs_the_preflight_then_num_warmups_plain_calls(emulated):
    calls = []

    def forward():
        calls.append(torch._C._len_torch_dispatch_stack())  # the checker is a dispatch mode
        return torch.ones(1)

    emulated.warmup(forward, num_warmups=3)
    assert len(calls) == 4 and calls[0] > 0 and calls[1:] == [0, 0, 0]
    emulated.warmup(forward, num_warmups=0)  # the preflight alone: allowed on the emulated backend
    assert len(calls) == 5
    with pytest.raises(ValueError, match="num_warmups must be an int >= 0; got -1"):
        emulated.warmup(lambda: torch.ones(1), num_warmups=-1)


def test_reset_releases_every_graph(emulated):
    x = torch.randn(4)
    graphs = [emulated.capture(lambda k=k: x * k, {"x": x}, name=f"k{k}") for k in range(3)]
    emulated.reset()
    assert emulated.graphs == () and emulated.memory_in_use() == 0
    assert all(g.is_released for g in graphs)


def test_get_backend_picks_emulated_on_cpu():
    backend = get_backend("auto", "cpu")
    assert isinstance(backend, EmulatedBackend) and backend.name == "emulated"
    assert backend.device == torch.device("cpu") and backend.free_memory() is None
    assert isinstance(get_backend("emulated", torch.device("cpu")), EmulatedBackend)


def test_get_backend_rejects_unknown_names():
    message = "unknown graph backend 'tpu'; valid choices: auto, cuda, emulated"
    with pytest.raises(ValueError, match=message):
        get_backend("tpu", "cpu")
    assert BACKEND_NAMES == ("auto", "cuda", "emulated")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_backend_without_cuda_points_to_emulated():
    with pytest.raises(CaptureError, match=r"CUDA.*use backend 'emulated', the CPU backend"):
        get_backend("cuda", "cuda")


def test_tensor_aliasing_an_intermediate_outside_aten_is_refused(emulated):
    x = torch.randn(4)

    def forward():
        h = x * 2
        return h.as_subclass(torch.Tensor) + 1  # no aten op: replay would read stale h

    with pytest.raises(CaptureError, match="shares memory with an intermediate"):
        emulated.capture(forward, {"x": x}, name="key")
    assert emulated.graphs == ()


def test_op_returning_nested_tensors_is_refused(emulated):
    x = torch.rand(8, 2)

    def forward():
        hist, edges = torch.histogramdd(x, bins=[2, 2])
        return hist.sum() + edges[0].sum()

    with pytest.raises(CaptureError, match=r"aten\.histogramdd\.default returns tensors nested"):
        emulated.capture(forward, {"x": x}, name="key")


def test_native_binding_reaches_the_recorded_overload_without_running_it():
    a, b = torch.ones(3), torch.full((3,), 2.0)
    aten = torch.ops.aten
    with torch.inference_mode():
        assert native_binding(aten.add.Tensor, (a, b), {}) is torch._C._VariableFunctions.add
        assert native_binding(aten.add_.Tensor, (a, b), {}) is torch._C.TensorBase.add_
        assert native_binding(aten.slice.Tensor, (a, 0, 1, 3), {}) is None  # no such binding
    torch.testing.assert_close(a, torch.ones(3), rtol=0, atol=0)  # the probe ran no kernel
