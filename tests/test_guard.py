"""Replays read what was captured: a moved or replaced static tensor is refused on every replay.

`graphcap.checks.guard.StaticGuard` through `CaptureManager`: parameters, buffers and submodules of the
model, tensors given to `register_static`, at every invariant level, with the default config
(`verify_replay: true`, whose verification replays once used to hide the first-replay check).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import graphcap
from graphcap import CaptureManager, StaticInputMovedError, StepBatch
from graphcap.checks.guard import StaticGuard
from graphcap.testing import MOVES, make_config, make_manager

BATCH = StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]])


@pytest.fixture
def manager():
    manager = make_manager(make_config(checks__invariants="basic"))  # the defaults: basic, verify_replay on
    assert manager.config.checks.verify_replay
    manager.capture()
    return manager


def replace_lm_head(model) -> None:
    model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone() * 2, requires_grad=False)


def test_replaced_weight_after_capture_is_refused_on_the_first_step(manager):
    replace_lm_head(manager.model)
    with pytest.raises(StaticInputMovedError, match=r"parameter 'model\.lm_head' was replaced") as info:
        manager.execute(BATCH)
    assert info.value.input_name == "model.lm_head"
    assert isinstance(info.value, graphcap.CaptureError)


@pytest.mark.parametrize("level", ["basic", "full", "off"])
def test_replaced_weight_after_many_real_replays_is_refused_at_every_level(level):
    manager = make_manager(make_config(checks__invariants=level))
    manager.capture()
    for _ in range(3):
        manager.execute(BATCH)
    replace_lm_head(manager.model)
    with pytest.raises(StaticInputMovedError, match="lm_head"):
        manager.execute(BATCH)
    with pytest.raises(StaticInputMovedError, match="lm_head"):  # refused until capture() runs again
        manager.execute(BATCH)
    manager.capture()
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


@pytest.mark.parametrize(
    "move",
    [
        lambda model: setattr(model.lm_head, "data", model.lm_head.detach().clone()),
        lambda model: model.norm.set_(model.norm.detach().clone()),
        lambda model: setattr(model.layers[0].qkv_proj, "data", model.layers[0].qkv_proj.detach().clone()),
    ],
    ids=["data_swap", "set_", "nested_data_swap"],
)
@pytest.mark.parametrize("level", ["off", "basic"])
def test_storage_swapped_under_a_recorded_parameter_is_refused_at_every_level(level, move):
    manager = make_manager(make_config(checks__invariants=level))
    manager.capture()
    manager.execute(BATCH)
    with torch.no_grad():
        move(manager.model)
    with pytest.raises(StaticInputMovedError, match=r"moved after capture: data_ptr 0x[0-9a-f]+ at capture"):
        manager.execute(BATCH)


@pytest.mark.parametrize(
    ("replace", "match"),
    [
        (lambda m: m.layers.__setitem__(0, copy.deepcopy(m.layers[0])), r"submodule 'model\.layers\.0'"),
        (lambda m: setattr(m, "kv_cache", m.kv_cache.clone()), r"buffer 'model\.kv_cache'"),
    ],
    ids=["submodule", "buffer"],
)
def test_replaced_submodule_and_buffer_are_refused(replace, match):
    manager = make_manager(make_config())
    manager.capture()
    replace(manager.model)
    with pytest.raises(StaticInputMovedError, match=match):
        manager.execute(BATCH)


def test_assigning_the_same_parameter_again_is_not_a_move(manager):
    manager.model.lm_head = manager.model.lm_head
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


def test_other_modules_in_the_process_do_not_disturb_the_guard(manager):
    other = torch.nn.Linear(2, 2)
    other.weight = torch.nn.Parameter(torch.zeros(2, 2))  # fires the global hook for a foreign module
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


def test_parameter_put_back_after_a_replacement_is_accepted_and_an_in_place_update_is_read(manager):
    captured = manager.model.lm_head
    replace_lm_head(manager.model)
    with pytest.raises(StaticInputMovedError, match=r"'model\.lm_head' was replaced"):
        manager.execute(BATCH)
    manager.model.lm_head = captured  # the very object the graphs read
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))
    with torch.no_grad():
        captured.mul_(-2)  # a weight update in place: same memory, new values
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (
            lambda m: m._parameters.__setitem__("lm_head", torch.nn.Parameter(m.lm_head.detach() * 2)),
            r"parameter 'model\.lm_head' was replaced",
        ),
        (lambda m: m._buffers.__setitem__("rope_cos", m.rope_cos * 2), r"buffer 'model\.rope_cos' was replaced"),
        (
            lambda m: m.layers._modules.__setitem__("0", copy.deepcopy(m.layers[0])),
            r"submodule 'model\.layers\.0' was replaced",
        ),
    ],
    ids=["_parameters", "_buffers", "_modules"],
)
@pytest.mark.parametrize("level", ["off", "full"])
def test_writes_straight_into_a_modules_own_dicts_are_refused(level, write, match):
    manager = make_manager(make_config(checks__invariants=level))
    manager.capture()
    manager.execute(BATCH)
    write(manager.model)  # no registration hook fires for these
    with pytest.raises(StaticInputMovedError, match=match):
        manager.execute(BATCH)


def test_a_moved_tensor_the_graph_writes_is_refused_before_the_launch_a_moved_weight_right_after_it():
    manager = make_manager(make_config(checks__invariants="off"))
    manager.capture()
    manager.execute(BATCH)
    graph = manager.graphs[manager.last_key]
    launches, launch = [], graph._replay
    graph._replay = lambda: (launches.append(1), launch())
    cache = manager.model.kv_cache.data
    manager.model.kv_cache.data = cache.clone()  # the graph would write the old cache
    with pytest.raises(StaticInputMovedError, match=r"'model\.kv_cache' moved after capture"):
        manager.execute(BATCH)
    assert launches == []
    manager.model.kv_cache.data = cache
    manager.model.lm_head.data = manager.model.lm_head.detach() * 2  # read only: swept while the launch runs
    with pytest.raises(StaticInputMovedError, match=r"'model\.lm_head' moved after capture"):
        manager.execute(BATCH)
    assert launches == [1]  # launched, then refused before execute returned the stale output


@pytest.mark.parametrize("move", MOVES, ids=lambda m: m.name.split(" (")[0])
def test_every_move_is_refused_at_invariants_off_while_it_lasts(move):
    manager = make_manager(make_config(checks__invariants="off"))
    manager.register_static("extra", torch.zeros(8))
    manager.capture()
    manager.execute(BATCH)
    move.apply(manager)
    for _ in range(2):
        with pytest.raises(StaticInputMovedError, match=move.match):
            manager.execute(BATCH)
    manager.capture()
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


def test_static_input_moved_error_is_exported_from_graphcap():
    assert "StaticInputMovedError" in graphcap.__all__
    assert issubclass(graphcap.StaticInputMovedError, graphcap.CaptureError)


# -- tensors that are not parameters: register_static -------------------------------------


SCRATCH = range(40, 72)  # free blocks of TINY's cache (BATCH uses blocks below 40)


class ListCacheModel:
    """Not an nn.Module: its KV-cache-like state is a plain list of tensors, as vLLM holds it."""

    def __init__(self, num_slots: int = 72 * 4) -> None:  # TINY's kv_cache: 72 blocks of 4
        self.caches = [torch.zeros(num_slots), torch.zeros(num_slots)]
        self.weight = torch.linspace(-1, 1, 64)

    def forward(self, inputs) -> torch.Tensor:
        slots = inputs.slot_mapping.long().clamp(min=0)
        values = inputs.input_ids.float()
        self.caches[0].index_copy_(0, slots, values)  # a write, as a KV cache gets
        read = self.caches[0].index_select(0, slots) + self.caches[1].index_select(0, slots)
        return (read[:, None] * self.weight[None, :]).contiguous()  # [T, 64]


def list_manager(**overrides) -> tuple[CaptureManager, ListCacheModel]:
    model = ListCacheModel()
    manager = CaptureManager(model, make_config(**overrides), progress=False)
    for i, cache in enumerate(model.caches):
        manager.register_static(f"kv_cache.{i}", cache)
    manager.register_static("weight", model.weight)
    manager.capture(scratch_blocks=SCRATCH)  # the model reads back its writes by slot: verification needs room
    return manager, model


def test_registered_tensor_of_a_plain_list_replays_equal_to_eager():
    manager, _ = list_manager()
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


def test_registered_tensor_whose_storage_changes_is_refused_and_named():
    manager, model = list_manager()
    manager.execute(BATCH)
    model.caches[1].data = torch.ones(72 * 4)  # re-allocated behind the graph's back
    with pytest.raises(StaticInputMovedError, match=r"'static\.kv_cache\.1' moved after capture") as info:
        manager.execute(BATCH)
    assert info.value.input_name == "static.kv_cache.1"


def test_name_registered_again_at_another_address_is_refused_until_capture():
    manager, model = list_manager()
    model.caches[0] = torch.zeros(72 * 4)  # the engine re-allocates its cache ...
    manager.register_static("kv_cache.0", model.caches[0])  # ... and says so
    with pytest.raises(StaticInputMovedError, match=r"'static\.kv_cache\.0' was registered again"):
        manager.execute(BATCH)
    manager.capture(scratch_blocks=SCRATCH)  # the new tensor is captured
    torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))


def test_registering_the_same_tensor_again_is_harmless():
    manager, model = list_manager()
    manager.register_static("kv_cache.0", model.caches[0])
    manager.execute(BATCH)


@pytest.mark.parametrize(("name", "tensor"), [("", torch.zeros(1)), ("x", [1, 2])])
def test_register_static_refuses_bad_arguments(name, tensor):
    manager = CaptureManager(ListCacheModel(), make_config(), progress=False)
    with pytest.raises(TypeError, match="register_static"):
        manager.register_static(name, tensor)


def test_registered_tensor_shrunk_in_place_at_the_same_address_is_refused():
    manager, model = list_manager()
    manager.execute(BATCH)
    address = model.weight.data_ptr()
    model.weight.resize_(32)
    assert model.weight.data_ptr() == address
    with pytest.raises(StaticInputMovedError, match=r"'static\.weight' changed in place after capture: shape \[64\]"):
        manager.execute(BATCH)


def test_registered_view_is_checked_through_the_base_the_forward_reads():
    base = torch.linspace(-1, 1, 72 * 4)  # the engine's whole cache; only a closure holds it

    class ReadsTheBase:
        def forward(self, inputs) -> torch.Tensor:
            slots = inputs.slot_mapping.long().clamp(min=0)
            return base.index_select(0, slots)[:, None].expand(-1, 8).contiguous()

    manager = CaptureManager(ReadsTheBase(), make_config(), progress=False)
    manager.register_static("cache", base[: 72 * 2])  # what the engine registered: a view of half of it
    manager.capture()
    manager.execute(BATCH)
    base.data = base.clone() * 2  # the base re-allocated; the registered view keeps the old memory
    with pytest.raises(StaticInputMovedError, match=r"'static\.cache\._base' moved after capture"):
        manager.execute(BATCH)


class _NoStorage(torch.Tensor):
    """A tensor subclass without storage of its own, like an FP8 weight wrapper or a DTensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a wrapper")


def test_registering_a_tensor_without_storage_names_it_and_what_to_register_instead():
    manager = CaptureManager(ListCacheModel(), make_config(), progress=False)
    with pytest.raises(graphcap.CaptureError, match=r"'static\.fp8' is a _NoStorage without storage .* register those"):
        manager.register_static("fp8", _NoStorage(torch.ones(4)))


# -- the guard's own cost ------------------------------------------------------------------


def test_guard_flags_exactly_the_moved_tensor_among_many():
    modules = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(150))  # 300 parameters
    guard = StaticGuard()
    assert len(guard.collect(modules, {})) == 300
    guard.arm(modules, {})
    guard.check()
    original = modules[97].bias.data
    with torch.no_grad():
        modules[97].bias.data = torch.zeros(4)
    guard.check_before_replay()  # parameters are read only: their sweep runs after the launch
    with pytest.raises(StaticInputMovedError, match=r"'model\.97\.bias' moved after capture"):
        guard.check_after_replay()
    with pytest.raises(StaticInputMovedError, match=r"'model\.97\.bias'"):
        guard.check()  # refused while it stays moved
    modules[97].bias.data = original  # the captured storage back: the graph reads exactly it again
    guard.check()
    guard.disarm()
    guard.check()


def test_disarmed_guard_removes_its_hooks():
    from torch.nn.modules import module as torch_module

    before = len(torch_module._global_parameter_registration_hooks)
    guard = StaticGuard()
    model = torch.nn.Linear(2, 2)
    guard.arm(model, {})
    assert len(torch_module._global_parameter_registration_hooks) == before + 1
    guard.disarm()
    assert len(torch_module._global_parameter_registration_hooks) == before


def test_captured_buffers_storage_is_part_of_the_static_set(manager):
    assert manager.buffers.storage()["packed"].data_ptr() == manager.buffers.packed_host.ctypes.data
    assert np.shares_memory(manager.buffers.packed_host, manager.buffers.host["query_start_loc"])
