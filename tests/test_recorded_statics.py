"""What a graph reads is found from its recording, not declared (`graphcap.checks.recorded`).

nano-vllm keeps each layer's KV cache as a plain attribute (`Attention.k_cache`, not a registered buffer); the
guard used to watch only parameters, buffers, submodules and `register_static`, so re-allocating such a cache
after capture was never refused and steps replayed the old cache. And a forward that allocates a new tensor on
every call and keeps it passed capture, then every `execute` advised a re-capture that allocated again.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphcap import CaptureError, CaptureManager, StaticInputMovedError, StepBatch
from graphcap.backends.preflight import preflight
from graphcap.backends.reads import ExternalReads
from graphcap.checks.guard import StaticGuard
from graphcap.checks.statics import held_tensors
from graphcap.testing import make_config

VOCAB, WIDTH, SLOTS = 128, 8, 73 * 4  # TINY's vocabulary; its cache of 72 blocks (and a scratch one) of 4 slots
BATCH = StepBatch([1, 2], [3, 5], [5, 6, 7], [[1, 2], [3, 4]])


class Attention(torch.nn.Module):
    """Keeps its cache as nano-vllm does: a plain tensor attribute the engine sets, no registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.k_cache = torch.tensor([])  # the engine binds the real cache after building the model

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        sink = torch.where(slots < 0, SLOTS - 1, slots)  # padded tokens write the last (scratch) slot
        self.k_cache.index_copy_(0, sink, x)
        return self.proj(x) + self.k_cache[4:8].sum(0)  # reads block 1, which no probe writes


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()


class NanoModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList([Layer() for _ in range(4)])

    def forward(self, inputs) -> torch.Tensor:
        x = self.embed(inputs.input_ids.long())
        slots = inputs.slot_mapping.long()
        for layer in self.layers:
            x = x + layer.attn(x, slots)
        return x


def _bind_caches(model: NanoModel) -> None:
    """What nano-vllm's `allocate_kv_cache` does: one engine tensor, each layer's cache a view set as an attribute."""
    kv = torch.zeros(len(model.layers), SLOTS, WIDTH)
    for i, layer in enumerate(model.layers):
        layer.attn.k_cache = kv[i]


def _nano_manager() -> tuple[CaptureManager, NanoModel]:
    model = NanoModel()
    _bind_caches(model)
    manager = CaptureManager(model, make_config(), progress=False)
    report = manager.capture()
    assert all(record.verified for record in report.captured)
    with torch.inference_mode():
        torch.testing.assert_close(manager.execute(BATCH).clone(), manager.eager(BATCH))
    return manager, model


def test_held_tensors_names_a_plain_module_attribute_as_python_would():
    model = NanoModel()
    _bind_caches(model)
    names = {r.name for r in held_tensors(model).values()}
    assert "model.layers[3].attn.k_cache" in names and "model.layers[0].attn.proj.weight" in names


def test_a_plain_attribute_cache_reallocated_after_capture_is_refused_naming_where_the_engine_keeps_it():
    manager, model = _nano_manager()
    model.layers[3].attn.k_cache = torch.zeros(SLOTS, WIDTH)  # the engine re-allocates one layer's cache
    with pytest.raises(
        StaticInputMovedError, match=r"attribute 'model\.layers\[3\]\.attn\.k_cache' was replaced by another object"
    ):
        manager.execute(BATCH)


def test_canary_without_the_recorded_reads_a_reallocated_cache_replays_the_old_one(monkeypatch):
    monkeypatch.setattr(StaticGuard, "add_read", lambda *args: None)
    manager, model = _nano_manager()
    _bind_caches(model)  # every layer's cache re-allocated: the graphs still write and read the old ones
    for layer in model.layers:
        layer.attn.k_cache.fill_(3.0)
    with torch.inference_mode():
        replayed = manager.execute(BATCH).clone()
        expected = manager.eager(BATCH)
    assert not torch.allclose(replayed, expected), "the hazard: the replay read the captured cache"


def test_a_cache_reached_by_no_path_is_still_guarded_by_its_storage():
    manager, model = _nano_manager()
    cache = model.layers[0].attn.k_cache
    hidden = {"kept": cache}
    del model.layers[0].attn.k_cache  # the model no longer names it; the graph still reads it
    model.layers[0].attn.k_cache = hidden["kept"]
    cache.set_(torch.zeros(SLOTS, WIDTH).untyped_storage())  # its storage swapped under the same object
    with pytest.raises(StaticInputMovedError, match=r"k_cache' moved after capture"):
        manager.execute(BATCH)


class Reallocating(torch.nn.Module):
    """Allocates a new state tensor on every call and keeps it (the model's state is always the newest)."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.registered = registered
        if registered:
            self.register_buffer("kv", torch.zeros(4, WIDTH))
        else:
            self.kv = torch.zeros(4, WIDTH)

    def forward(self, inputs) -> torch.Tensor:
        x = self.embed(inputs.input_ids.long())
        self.kv = torch.zeros(4, WIDTH, device=x.device) + x.mean()  # a new tensor on every call, kept
        return x + self.kv.sum()


@pytest.mark.parametrize("registered", [False, True], ids=["plain_attribute", "buffer"])
def test_a_forward_that_allocates_and_keeps_a_tensor_on_every_call_is_refused_at_capture(registered):
    manager = CaptureManager(Reallocating(registered), make_config({"capture.on_error": "raise"}), progress=False)
    with pytest.raises(CaptureError, match=r"model\.kv holds a tensor the forward allocated while .* was captured"):
        manager.capture()
    assert not manager.graphs


def test_a_forward_that_allocates_and_keeps_a_tensor_is_skipped_under_on_error_skip_naming_it():
    manager = CaptureManager(Reallocating(False), make_config({"capture.on_error": "skip"}), progress=False)
    report = manager.capture()
    assert not manager.graphs
    assert all("model.kv holds a tensor the forward allocated" in record.reason for record in report.records)


def test_the_preflight_collects_what_a_cuda_forward_reads_under_fake_tensors():
    # The CUDA path: the preflight that warms up every CUDA capture collects the reads (CUDA-device fake tensors).
    reads = ExternalReads()
    with FakeTensorMode(allow_non_fake_inputs=True):
        cache = torch.zeros(16, 8, device="cuda")
        weight = torch.randn(8, 8, device="cuda")
        x = torch.randn(4, 8, device="cuda")
        slots = torch.arange(4, device="cuda")

        def forward() -> torch.Tensor:
            cache.index_copy_(0, slots, x @ weight)  # written in place
            made = torch.ones(4, 8, device="cuda")  # made by the forward: not a read
            return cache.index_select(0, slots) + made

        with torch.inference_mode(), preflight("cuda", reads=reads):
            forward()
        found = reads.tensors()
    assert any(t is cache for t in found) and any(t is weight for t in found) and any(t is x for t in found)
    assert len(found) == 4  # cache, weight, x, slots: nothing the forward made


def test_a_backend_s_graph_reports_the_preflight_s_reads_where_its_recording_collected_none():
    from graphcap.backends import EmulatedBackend

    backend = EmulatedBackend("cpu")
    cache, x = torch.zeros(4), torch.ones(4)
    fn = lambda: cache.add_(x) * 2  # noqa: E731
    backend.warmup(fn, 0, checked=True)  # the preflight
    assert {id(t) for t in backend._reads.tensors()} == {id(cache), id(x)}
    graph = backend.capture(fn, {}, name="k")
    assert {id(t) for t in graph.reads} == {id(cache), id(x)}  # the recording's own
    graph.reads = None
    backend.warmup(fn, 0, checked=True)
    graph = backend.capture_pieces(lambda session: fn(), {}, name="p")
    assert {id(t) for t in graph.reads} == {id(cache), id(x)}  # a piecewise graph: the preflight's
