"""Every op in the unsafe table is refused during capture and during the first warmup.

Each message must name the op and the line of this file that called it. The triggers are
keyed by table entry, so a new entry without a trigger fails `test_every_unsafe_op_...`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphcap import CaptureManager
from graphcap.backends import UNSAFE_OPS, CaptureUnsafeError, check_capture_safe
from graphcap.backends.preflight import unsafe_op_checker
from graphcap.models import build_model
from graphcap.testing import make_config
from tests.backends.conftest import marked_line


def _tensors(device: str = "cpu") -> SimpleNamespace:
    """The triggers' inputs on `device` (under FakeTensorMode for "cuda": no GPU needed)."""
    if device == "cpu":
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    else:
        x = torch.randn(4, 8, device=device)  # a fake tensor: shapes and devices, no values
    return SimpleNamespace(
        x=x,  # [4, 8] float32, both signs
        mask=x > 0,  # [4, 8] bool
        i=torch.tensor(2, device=device),  # 0-dim int64
        r=torch.tensor([1, 0, 2, 1], device=device),  # [4] small non-negative int64
        zero=torch.tensor(0.0),  # a host scalar (as x[mask] = 0.0 makes)
        fill=torch.zeros((), device=device),  # a 0-dim tensor on the graph's device
        rows=torch.tensor([0, 2], device=device),
        host=torch.ones(4, 8),  # pageable host memory
        stream=None,  # a CPU build cannot make a torch.cuda.Stream; the checker refuses before reading it
        pg=_bare_process_group(),  # what dist.all_reduce(t) calls; the checker refuses before it runs
    )


def _bare_process_group():
    import torch.distributed as dist

    return dist.ProcessGroup(dist.HashStore(), 0, 1)


def _local_scalar_dense(t):
    return torch.ops.aten._local_scalar_dense.default(t.i)  # unsafe


def _item_from_slicing(t):
    return t.x.narrow(0, 0, t.i)  # unsafe (C++ reads the length with aten.item)


def _is_nonzero(t):
    return torch.is_nonzero(t.i)  # unsafe


def _equal(t):
    return torch.equal(t.x, t.x)  # unsafe


def _nonzero(t):
    return torch.nonzero(t.x)  # unsafe


def _nonzero_as_tuple(t):
    return torch.nonzero(t.x, as_tuple=True)  # unsafe


def _argwhere(t):
    return torch.argwhere(t.x)  # unsafe


def _where_one_arg(t):
    return torch.where(t.mask)  # unsafe


def _masked_select(t):
    return t.x.masked_select(t.mask)  # unsafe


def _unique_private(t):
    return torch._unique(t.r)  # unsafe


def _unique(t):
    return torch.unique(t.r)  # unsafe


def _unique_dim(t):
    return torch.unique(t.x, dim=0)  # unsafe


def _unique_consecutive(t):
    return torch.unique_consecutive(t.r)  # unsafe


def _unique_dim_consecutive(t):
    return torch.ops.aten.unique_dim_consecutive.default(t.x, 0)  # unsafe


def _mask_index(t):
    return t.x[t.mask]  # unsafe


def _mask_index_put(t):
    return t.x.index_put((t.mask,), t.zero, accumulate=True)  # unsafe (accumulate: no masked_fill_)


def _mask_index_put_(t):
    return t.x.clone().index_put_((t.mask,), t.zero, accumulate=True)  # unsafe


def _mask_index_put_impl(t):
    return torch._index_put_impl_(t.x.clone(), (t.mask,), t.zero, accumulate=True)  # unsafe


def _repeat_interleave(t):
    return torch.repeat_interleave(t.x, t.r, dim=0)  # unsafe


def _bincount(t):
    return torch.bincount(t.r, minlength=8)  # unsafe


def _item(t):
    return t.x.sum().item()  # unsafe


def _int(t):
    return int(t.i)  # unsafe


def _float(t):
    return float(t.x.sum())  # unsafe


def _bool(t):
    if t.i:  # unsafe
        return t.x
    return -t.x


def _index(t):
    return range(t.i)  # unsafe


def _tolist(t):
    return t.x.tolist()  # unsafe


def _numpy(t):
    return t.x.numpy()  # unsafe


def _array(t):
    return np.asarray(t.x)  # unsafe


def _cpu(t):
    return t.x.cpu()  # unsafe


def _to_cpu(t):
    return t.x.to("cpu")  # unsafe


def _print(t):
    print(t.x)  # unsafe
    return t.x


def _format(t):
    return f"{t.x.sum():.3f}"  # unsafe


def _upload_with_to(t):
    return t.host.to(t.x.device)  # unsafe (a pageable host -> device copy)


def _copy_from_host(t):
    return t.x.clone().copy_(t.host)  # unsafe


def _masked_fill_device_value(t):
    return t.x.masked_fill(t.mask, t.fill)  # unsafe (the CUDA kernel calls fill.item())


def _masked_fill_device_value_(t):
    return t.x.clone().masked_fill_(t.mask, t.fill)  # unsafe


def _index_fill_device_value(t):
    return t.x.index_fill(0, t.rows, t.fill)  # unsafe


def _index_fill_device_value_(t):
    return t.x.clone().index_fill_(0, t.rows, t.fill)  # unsafe


def _tensor_of_a_list(t):
    return torch.tensor([1.0, 2.0], device=t.x.device)  # unsafe


def _as_tensor_of_a_list(t):
    return torch.as_tensor([1.0, 2.0], device=t.x.device)  # unsafe


def _asarray_of_a_list(t):
    return torch.asarray([1.0, 2.0], device=t.x.device)  # unsafe


def _synchronize(t):
    torch.cuda.synchronize()  # unsafe
    return t.x


def _empty_cache(t):
    torch.cuda.empty_cache()  # unsafe
    return t.x


def _stream_synchronize(t):
    torch.cuda.Stream.synchronize(t.stream)  # unsafe
    return t.x


def _stream_query(t):
    return torch.cuda.Stream.query(t.stream)  # unsafe


def _event_synchronize(t):
    torch.cuda.Event.synchronize(t.stream)  # unsafe
    return t.x


def _event_query(t):
    return torch.cuda.Event.query(t.stream)  # unsafe


TRIGGERS = {
    "aten._local_scalar_dense": _local_scalar_dense,
    "aten.item": _item_from_slicing,
    "aten.is_nonzero": _is_nonzero,
    "aten.equal": _equal,
    "aten.nonzero": _nonzero,
    "aten.nonzero_numpy": _nonzero_as_tuple,
    "aten.argwhere": _argwhere,
    "aten.where": _where_one_arg,
    "aten.masked_select": _masked_select,
    "aten._unique": _unique_private,
    "aten._unique2": _unique,
    "aten.unique_dim": _unique_dim,
    "aten.unique_consecutive": _unique_consecutive,
    "aten.unique_dim_consecutive": _unique_dim_consecutive,
    "aten.index": _mask_index,
    "aten.index_put": _mask_index_put,
    "aten.index_put_": _mask_index_put_,
    "aten._index_put_impl_": _mask_index_put_impl,
    "aten.repeat_interleave": _repeat_interleave,
    "aten.bincount": _bincount,
    "Tensor.item": _item,
    "Tensor.__int__": _int,
    "Tensor.__float__": _float,
    "Tensor.__bool__": _bool,
    "Tensor.__index__": _index,
    "Tensor.tolist": _tolist,
    "Tensor.numpy": _numpy,
    "Tensor.__array__": _array,
    "Tensor.cpu": _cpu,
    "Tensor.to": _to_cpu,
    "Tensor.__repr__": _print,
    "Tensor.__format__": _format,
    "aten._to_copy": _upload_with_to,
    "aten.copy_": _copy_from_host,
    "aten.masked_fill": _masked_fill_device_value,
    "aten.masked_fill_": _masked_fill_device_value_,
    "aten.index_fill": _index_fill_device_value,
    "aten.index_fill_": _index_fill_device_value_,
    "torch.tensor": _tensor_of_a_list,
    "torch.as_tensor": _as_tensor_of_a_list,
    "torch.asarray": _asarray_of_a_list,
    "torch.cuda.synchronize": _synchronize,
    "torch.cuda.empty_cache": _empty_cache,
    "torch.cuda.Stream.synchronize": _stream_synchronize,
    "torch.cuda.Stream.query": _stream_query,
    "torch.cuda.Event.synchronize": _event_synchronize,
    "torch.cuda.Event.query": _event_query,
    "c10d.allreduce_": lambda t: t.pg.allreduce([t.x]),  # unsafe
    "c10d.allgather_": lambda t: t.pg.allgather([[t.x.clone()]], [t.x]),  # unsafe
    "c10d._allgather_base_": lambda t: t.pg._allgather_base(t.x.clone(), t.x),  # unsafe
    "c10d.reduce_scatter_": lambda t: t.pg.reduce_scatter([t.x.clone()], [[t.x]]),  # unsafe
    "c10d._reduce_scatter_base_": lambda t: t.pg._reduce_scatter_base(t.x.clone(), t.x),  # unsafe
    "c10d.broadcast_": lambda t: t.pg.broadcast([t.x]),  # unsafe
    "c10d.alltoall_base_": lambda t: t.pg.alltoall_base(t.x.clone(), t.x, [], []),  # unsafe
}
EMULATED_ONLY = {name for name in UNSAFE_OPS if name.startswith("c10d.")}
"""In-place collectives: a CUDA graph holds them (NCCL), the emulated backend's tape cannot (a Work)."""
# torch's Python bindings of x[mask], torch.nonzero and copy_ take a CUDA device guard before
# any mode sees the call, and a CPU-only build has no CUDA guard: on such a build the fake-CUDA
# test reaches the same aten ops through their OpOverloads (a CUDA build runs the bindings).
GUARDED_BINDINGS = {
    "aten.index": lambda t: torch.ops.aten.index.Tensor(t.x, [t.mask]),  # unsafe
    "aten.nonzero": lambda t: torch.ops.aten.nonzero.default(t.x),  # unsafe
    "aten.nonzero_numpy": lambda t: torch.ops.aten.nonzero_numpy.default(t.x),  # unsafe
}
# FakeTensor overrides tolist() with a loop of .item() calls; the C method is the one to check.
FAKE_FORMS = {"Tensor.tolist": lambda t: torch.Tensor.tolist(t.x)}  # unsafe
CUDA_ONLY = {
    "aten._to_copy",
    "aten.copy_",
    "aten.masked_fill",
    "aten.masked_fill_",
    "aten.index_fill",
    "aten.index_fill_",
    "torch.tensor",
    "torch.as_tensor",
    "torch.asarray",
}
"""Rows about crossing between host and device memory: with the CPU as the graph's device
(the emulated backend) there is no crossing, so only a CUDA device (fake or real) shows them."""


def _assert_names(error: CaptureUnsafeError, op_name: str, trigger) -> None:
    message = str(error)
    assert error.op.startswith(op_name), message
    assert message.startswith(f"{error.op} at "), message
    assert marked_line(trigger) in message, message
    assert UNSAFE_OPS[op_name].reason in message


@pytest.mark.parametrize("stage", ["capture", "warmup"])
@pytest.mark.parametrize("op_name", sorted(set(UNSAFE_OPS) - CUDA_ONLY))
def test_every_unsafe_op_is_refused_naming_op_and_user_line(emulated, op_name, stage):
    trigger = TRIGGERS[op_name]  # KeyError: a table entry without a trigger here
    t = _tensors()
    with pytest.raises(CaptureUnsafeError) as caught:
        if stage == "capture":
            emulated.capture(lambda: trigger(t), {"x": t.x}, name="key")
        else:
            emulated.warmup(lambda: trigger(t), num_warmups=1)
    _assert_names(caught.value, op_name, trigger)
    assert emulated.graphs == ()


@pytest.mark.parametrize("op_name", sorted(set(UNSAFE_OPS) - EMULATED_ONLY))
def test_every_unsafe_op_is_named_on_cuda_tensors_under_fake_tensor_mode(op_name):
    """check_capture_safe on fake CUDA tensors: the verdicts the preflight gives on a GPU."""
    trigger = FAKE_FORMS.get(op_name, TRIGGERS[op_name])
    if not torch.cuda.is_available():
        trigger = GUARDED_BINDINGS.get(op_name, trigger)
    with FakeTensorMode(allow_non_fake_inputs=True):
        t = _tensors("cuda")
        with pytest.raises(CaptureUnsafeError) as caught:
            check_capture_safe(lambda: trigger(t), "cuda")
    _assert_names(caught.value, op_name, trigger)


@pytest.mark.parametrize("op_name", sorted(CUDA_ONLY))
def test_host_device_crossings_are_invisible_when_the_graph_device_is_the_cpu(emulated, op_name):
    # docs/EMULATION.md: the emulated backend's device is the host, so nothing crosses.
    t = _tensors()
    emulated.capture(lambda: TRIGGERS[op_name](t), {"x": t.x}, name="key")


def test_triggers_cover_exactly_the_table():
    assert set(TRIGGERS) == set(UNSAFE_OPS)
    assert set(UNSAFE_OPS) > CUDA_ONLY


def test_message_says_what_where_why_and_the_fix(emulated):
    t = _tensors()
    with pytest.raises(CaptureUnsafeError) as caught:
        emulated.capture(lambda: _nonzero(t), {}, name="key")
    assert str(caught.value) == (
        f"aten.nonzero at {caught.value.location}: the output shape depends on tensor values, "
        "so the host must wait for the GPU; a CUDA graph cannot hold a host sync. Use a "
        "fixed-size formulation (torch.where(mask, x, fill), nonzero_static, or pass output_size=)."
    )
    assert caught.value.location.endswith(marked_line(_nonzero))


def test_overload_is_named_when_not_default(emulated):
    t = _tensors()
    with pytest.raises(CaptureUnsafeError, match=r"aten\.repeat_interleave\.self_Tensor at "):
        emulated.capture(lambda: _repeat_interleave(t), {}, name="key")


def _masked_scalar_store(t):
    y = t.x.clone()
    y[t.mask] = 0.0  # one mask index, a host scalar: index_put_ runs masked_fill_, no sync
    return y


def _safe_formulations(t, total_repeats: int):
    return (
        _masked_scalar_store(t).sum()
        + torch.repeat_interleave(t.x, t.r, dim=0, output_size=total_repeats).sum()
        + torch.repeat_interleave(t.x, 2, dim=0).sum()  # self_int: a fixed length
        + torch.where(t.mask, t.x, 0.0).sum()
        + t.x[t.r].sum()  # an integer index
        + t.x.masked_fill(~t.mask, 0.0).sum()
        + t.x.to(torch.float64).float().sum()
        + t.x.to(torch.device("cpu")).sum()  # the graph's own device, not a host copy
        + torch.zeros(8).scatter_add_(0, t.r, torch.ones(4)).sum()  # bincount at a fixed size
    )


def test_fixed_size_formulations_are_captured(emulated):
    t = _tensors()
    total = int(t.r.sum())  # a host value computed before the forward, as prepare() would
    graph = emulated.capture(lambda: _safe_formulations(t, total), {}, name="key")
    torch.testing.assert_close(graph.replay(), _safe_formulations(t, total), rtol=0, atol=0)


def test_only_ops_on_the_graph_device_count():
    # A CUDA forward may read host-side metadata: stand in for the GPU with the meta device.
    host = torch.tensor([0, 3, 0, 1])
    device_tensor = torch.empty(4, device="meta")
    with unsafe_op_checker("meta"):
        assert torch.nonzero(host).shape == (2, 1)
        assert host.tolist() == [0, 3, 0, 1]
        assert int(host[1]) == 3
    with pytest.raises(CaptureUnsafeError, match=r"aten\.nonzero"), unsafe_op_checker("meta"):
        torch.nonzero(device_tensor)
    with pytest.raises(CaptureUnsafeError, match=r"Tensor\.cpu"), unsafe_op_checker("meta"):
        device_tensor.cpu()
    with pytest.raises(CaptureUnsafeError, match=r"Tensor\.to"), unsafe_op_checker("meta"):
        device_tensor.to(torch.device("cpu"))  # another device than the graph's: the host


def test_masked_store_of_a_host_scalar_is_not_flagged_on_cuda_tensors():
    # The preflight used to refuse it as a mask index; ATen turns it into masked_fill_.
    with FakeTensorMode(allow_non_fake_inputs=True):
        t = _tensors("cuda")
        if torch.cuda.is_available():
            store = _masked_scalar_store
        else:  # Python's x[mask] = v takes a CUDA device guard first (see GUARDED_BINDINGS)
            store = lambda t: torch.ops.aten.index_put_.default(t.x.clone(), [t.mask], torch.tensor(0.0))  # noqa: E731
        assert check_capture_safe(lambda: store(t), "cuda").shape == (4, 8)
        with pytest.raises(CaptureUnsafeError, match=r"aten\.index_put_ at "):
            check_capture_safe(lambda: torch.ops.aten.index_put_.default(t.x, [t.mask], t.fill), "cuda")


def test_pinned_non_blocking_uploads_are_not_flagged():
    from graphcap.backends.unsafe import UNSAFE_OPS as table

    class Pinned(torch.Tensor):  # a CPU-only build cannot pin memory: a host tensor that says it is
        def is_pinned(self, device=None) -> bool:
            return True

    to_copy, copy = table["aten._to_copy"].applies, table["aten.copy_"].applies
    cuda, target = torch.device("cuda"), torch.empty(1, device="meta")
    host = torch.ones(2)
    pinned = host.as_subclass(Pinned)
    assert to_copy(None, (host,), {"device": cuda}, cuda)  # pageable: refused
    assert not to_copy(None, (pinned,), {"device": cuda, "non_blocking": True}, cuda)
    assert to_copy(None, (pinned,), {"device": cuda}, cuda)  # blocking: a sync even from pinned memory
    assert to_copy(None, (target,), {"device": torch.device("cpu")}, torch.device("meta"))  # to the host
    assert not copy(None, (target, pinned, True), {}, torch.device("meta"))
    assert copy(None, (target, host, True), {}, torch.device("meta"))
    assert copy(None, (target, pinned), {}, torch.device("meta"))


def test_check_capture_safe_returns_the_result_and_takes_meta_tensors_as_the_gpu():
    # meta tensors are a stand-in for the GPU that runs Python indexing on any build.
    x, w = torch.randn(4, 8, device="meta"), torch.randn(8, 8, device="meta")
    out = check_capture_safe(lambda: torch.nn.functional.linear(x[:2], w)[0], "meta")
    assert out.shape == (8,) and out.device.type == "meta"
    with pytest.raises(CaptureUnsafeError, match=r"aten\._to_copy at "):
        check_capture_safe(lambda: x + torch.ones(4, 8).to("meta"), "meta")
    with pytest.raises(TypeError, match="fn must be a callable taking no arguments; got Tensor"):
        check_capture_safe(x, "meta")


def test_python_level_waits_are_refused_only_inside_the_checker_and_only_in_its_thread():
    import threading

    original = torch.cuda.empty_cache
    seen = []
    with unsafe_op_checker("cpu"):
        assert torch.cuda.empty_cache is not original
        worker = threading.Thread(target=lambda: seen.append(torch.cuda.empty_cache()))  # not checked
        worker.start()
        worker.join()
        with pytest.raises(CaptureUnsafeError, match=r"torch\.cuda\.empty_cache at "):
            torch.cuda.empty_cache()
    assert seen == [None] and torch.cuda.empty_cache is original
    assert torch.cuda.Stream.synchronize is vars(torch.cuda.Stream)["synchronize"]


@pytest.mark.parametrize(
    "upload",
    [
        lambda t: t.x.clone().copy_(t.host, non_blocking=True),  # pageable source: a sync after all
        lambda t: t.host.to("cuda"),
        lambda t: t.host.to(device="cuda", dtype=torch.float16),
        lambda t: t.host.cuda(),
    ],
    ids=["copy_-non-blocking-pageable", "to-string", "to-keywords", "cuda"],
)
def test_uploads_are_classified_by_their_arguments_before_they_run(upload):
    # Python's copy_/to/cuda enter the device before the dispatcher sees them: on a CPU-only build
    # they would raise inside torch ("not linked with support for cuda devices") instead of being named.
    with FakeTensorMode(allow_non_fake_inputs=True):
        t = _tensors("cuda")
        with pytest.raises(CaptureUnsafeError, match=r"^aten\.(_to_copy|copy_) at .*test_unsafe\.py:\d+: it copies"):
            check_capture_safe(lambda: upload(t), "cuda")
        x = t.x
        assert check_capture_safe(lambda: x.to(torch.float16), "cuda").dtype == torch.float16  # no crossing


class _Prints(torch.nn.Module):
    """The reference model with a debugging print left in its forward."""

    def __init__(self, config) -> None:
        super().__init__()
        self.inner = build_model(config)

    def forward(self, inputs) -> torch.Tensor:
        logits = self.inner(inputs)
        print("logits", logits)  # unsafe: on CUDA a device-to-host copy and a sync, frozen at capture
        return logits


def test_a_forward_that_prints_a_tensor_is_refused_at_capture_by_name_and_line():
    config = make_config()
    manager = CaptureManager(_Prints(config), config, progress=False)
    with pytest.raises(CaptureUnsafeError, match=r"Tensor\.__repr__ at .*test_unsafe\.py:\d+: it formats") as caught:
        manager.capture()
    assert marked_line(_Prints.forward) in str(caught.value)
    assert manager.graphs == {}


def test_in_place_collectives_are_refused_only_where_the_graph_device_is_the_cpu():
    # A CUDA graph holds an in-place NCCL all-reduce; the emulated backend's tape cannot hold a Work.
    from graphcap.backends.preflight import check_op

    allreduce = torch.ops.c10d.allreduce_.default
    check_op(allreduce, ([torch.empty(4, device="meta")],), {}, torch.device("meta"))
    with pytest.raises(CaptureUnsafeError, match=r"c10d\.allreduce_ at .*_functional_collectives\.all_reduce"):
        check_op(allreduce, ([torch.empty(4)],), {}, torch.device("cpu"))


def test_a_capture_pass_imports_neither_dynamo_nor_the_dtensor_stack():
    """The checker's modes carry no dynamo wrapper and verification compares without assert_close's set-up,
    so the first capture of a process pays neither import (each cost seconds of the first key)."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from graphcap import CaptureManager, load_config\n"
        "from graphcap.models import build_model\n"
        "config = load_config('tiny-cpu-ci')\n"
        "report = CaptureManager(build_model(config), config, progress=False).capture()\n"
        "assert report.records and all(r.verified for r in report.records)\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', 'sympy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
