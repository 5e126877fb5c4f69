"""Every op in the unsafe table is refused during capture and during the first warmup.

Each message must name the op and the line of this file that called it. The triggers are
keyed by table entry, so a new entry without a trigger fails `test_every_unsafe_op_...`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphcap.backends import UNSAFE_OPS, CaptureUnsafeError
from graphcap.backends.unsafe import unsafe_op_checker
from tests.backends.conftest import marked_line


def _tensors() -> SimpleNamespace:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    return SimpleNamespace(
        x=x,  # [4, 8] float32, both signs
        mask=x > 0,  # [4, 8] bool
        i=torch.tensor(2),  # 0-dim int64
        r=torch.tensor([1, 0, 2, 1]),  # [4] small non-negative int64
        zero=torch.tensor(0.0),
    )


def _local_scalar_dense(t):
    return torch.ops.aten._local_scalar_dense.default(t.i)  # unsafe


def _item_from_slicing(t):
    return t.x[: t.i]  # unsafe (C++ reads the bound with aten.item)


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
    return t.x.index_put((t.mask,), t.zero)  # unsafe


def _mask_setitem(t):
    y = t.x.clone()
    y[t.mask] = 0.0  # unsafe
    return y


def _mask_index_put_impl(t):
    return torch._index_put_impl_(t.x.clone(), (t.mask,), t.zero)  # unsafe


def _repeat_interleave(t):
    return torch.repeat_interleave(t.x, t.r, dim=0)  # unsafe


def _bincount(t):
    return torch.bincount(t.r, minlength=8)  # unsafe


def _item(t):
    return t.x[0, 0].item()  # unsafe


def _int(t):
    return int(t.i)  # unsafe


def _float(t):
    return float(t.x[0, 0])  # unsafe


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
    "aten.index_put_": _mask_setitem,
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
}


@pytest.mark.parametrize("stage", ["capture", "warmup"])
@pytest.mark.parametrize("op_name", sorted(UNSAFE_OPS))
def test_every_unsafe_op_is_refused_naming_op_and_user_line(emulated, op_name, stage):
    trigger = TRIGGERS[op_name]  # KeyError: a table entry without a trigger here
    t = _tensors()
    with pytest.raises(CaptureUnsafeError) as caught:
        if stage == "capture":
            emulated.capture(lambda: trigger(t), {"x": t.x}, name="key")
        else:
            emulated.warmup(lambda: trigger(t), num_warmups=1)
    message = str(caught.value)
    assert caught.value.op.startswith(op_name)
    assert message.startswith(f"{caught.value.op} at ")
    assert marked_line(trigger) in message, message
    assert UNSAFE_OPS[op_name].reason in message
    assert emulated.graphs == ()


def test_triggers_cover_exactly_the_table():
    assert set(TRIGGERS) == set(UNSAFE_OPS)


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


def _safe_formulations(t, total_repeats: int):
    return (
        torch.repeat_interleave(t.x, t.r, dim=0, output_size=total_repeats).sum()
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
