"""The per-overload caches of the emulated backend: a binding (and a checker row, a composite kernel) is
kept per overload and argument signature, never answered for another signature or another object."""

from __future__ import annotations

import pytest
import torch

from graphcap.backends import bindings, preflight
from graphcap.backends.bindings import native_binding, signature
from graphcap.backends.tape import TapeRecorder, compile_tape
from graphcap.errors import CaptureUnsafeError

aten = torch.ops.aten


@pytest.fixture
def fresh(monkeypatch):
    """Empty caches, and a count of the probes `native_binding` runs."""
    monkeypatch.setattr(bindings, "_found", {})
    probes = []
    probe = bindings._probe_bindings

    def counted(func, name, args, kwargs):
        probes.append((func, tuple(kwargs)))
        return probe(func, name, args, kwargs)

    monkeypatch.setattr(bindings, "_probe_bindings", counted)
    return probes


@pytest.mark.parametrize("floor_first", [True, False])
def test_a_binding_found_for_one_signature_never_answers_another(fresh, floor_first):
    a, b = torch.ones(3), torch.full((3,), 2.0)
    calls = [({"rounding_mode": "floor"}, torch._C._VariableFunctions.div), ({}, None)]  # torch.div(a, b) is div.Tensor
    with torch.inference_mode():
        for kwargs, expected in calls if floor_first else calls[::-1]:
            assert native_binding(aten.div.Tensor_mode, (a, b), kwargs) is expected
    assert len(fresh) == 2  # one probe per signature


def test_the_same_signature_is_probed_once_and_other_types_again(fresh):
    a, b, c = torch.ones(3), torch.full((3,), 2.0), torch.zeros(3)
    with torch.inference_mode():
        assert native_binding(aten.add.Tensor, (a, b), {}) is torch._C._VariableFunctions.add
        assert native_binding(aten.add.Tensor, (c, a), {}) is torch._C._VariableFunctions.add  # same types
        assert len(fresh) == 1
        native_binding(aten.add.Tensor, (a, torch.tensor(2.0)), {})  # a 0-dim tensor may stand for a number
        native_binding(aten.add.Tensor, (a, b), {"alpha": 2})
        native_binding(aten.add.Tensor, (a, b), {"alpha": 2.0})
        native_binding(aten.sub.Tensor, (a, b), {})  # another overload, the same arguments
    assert len(fresh) == 5
    assert signature(aten.add.Tensor, (a, b), {"alpha": 2}) != signature(aten.add.Tensor, (a, b), {"alpha": 2.0})


def test_an_entry_left_by_another_object_under_the_same_id_is_not_used(fresh):
    a, b = torch.ones(3), torch.full((3,), 2.0)
    bindings._found[signature(aten.add.Tensor, (a, b), {})] = (aten.sub.Tensor, torch._C._VariableFunctions.sub)
    with torch.inference_mode():
        assert native_binding(aten.add.Tensor, (a, b), {}) is torch._C._VariableFunctions.add
    assert len(fresh) == 1


def test_a_tape_compiled_after_another_signature_replays_each_call_as_recorded(fresh):
    a, b = torch.arange(1.0, 7.0), torch.full((6,), 4.0)

    def forward():
        return torch.div(a, b, rounding_mode="floor") + torch.div(a, b, rounding_mode="trunc") * 10

    with torch.inference_mode():
        recorder = TapeRecorder(torch.device("cpu"))
        with recorder:
            expected = forward()
        tape = compile_tape(recorder.records, [expected])
        a.mul_(3)  # the tape reads the externals' new values
        (replayed,) = tape.run()
        torch.testing.assert_close(replayed, forward(), rtol=0, atol=0)


def test_the_checker_s_row_and_kernel_caches_answer_by_identity(monkeypatch):
    item = aten._local_scalar_dense.default
    monkeypatch.setattr(preflight, "_ROWS", {id(item): (aten.add.Tensor, None)})  # as if another op had its id
    monkeypatch.setattr(preflight, "_KERNELS", {id(aten.linear.default): (aten.add.Tensor, None)})
    assert preflight._composite_kernel(aten.linear.default) is not None  # linear is composite: its parts are checked
    fake = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        on_cuda = torch.empty(2, device="cuda")
    with (
        pytest.raises(CaptureUnsafeError, match=r"aten\._local_scalar_dense at .*test_bindings\.py"),
        torch.inference_mode(),
    ):
        preflight.check_op(item, (on_cuda,), {}, torch.device("cuda"))
    assert preflight._row_for(aten.add.Tensor) is None  # no row: the stale entry was replaced
