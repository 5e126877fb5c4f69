"""The memory estimate against real tensors: exact for weights, cache and buffers, close for graphs.

Activations are compared with the emulated tape's liveness peak (what one replay holds), each
key's transient with every storage a real forward allocates (what recording holds, to the byte),
and the whole estimate with the exact peak of torch's CPU allocations over a real build and
capture (`graphcap.testing.allocations`) and with the peak resident memory of one in a fresh process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphcap import CaptureManager, load_config
from graphcap.batch import dummy_batch
from graphcap.keys import KeyRegistry
from graphcap.memory.estimate import MemoryEstimate, available_memory, estimate_memory
from graphcap.models import build_model
from graphcap.probe import REFERENCE_BYTES, probe_fills, probe_identity

SHAPES = {
    "default": {"capture.sizes": [1, 8, 32], "capture.max_size": 32},
    "bf16": {"capture.sizes": [1, 8, 32], "capture.max_size": 32, "model.dtype": "bfloat16"},
    "mha, long context": {
        **{"capture.sizes": [4, 16], "capture.max_size": 16, "model.hidden_size": 128, "model.num_layers": 3},
        **{"model.num_heads": 4, "model.num_kv_heads": 4, "model.vocab_size": 1000},
        **{"kv_cache.max_model_len": 1024, "kv_cache.num_blocks": 128, "kv_cache.block_size": 32},
    },
    "logits-bound fp16": {
        **{"capture.sizes": [2, 16, 64], "capture.max_size": 64, "model.hidden_size": 512, "model.num_layers": 1},
        **{"model.num_heads": 8, "model.num_kv_heads": 1, "model.vocab_size": 32000, "model.dtype": "float16"},
        **{"kv_cache.max_model_len": 64, "kv_cache.num_blocks": 64},
    },
}


class _Allocations(TorchDispatchMode):
    """Every storage a forward's ops create (views of earlier storages are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.tensors.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        return out


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def captured(request):
    config = load_config(overrides={"device": "cpu", **SHAPES[request.param]})
    model = build_model(config)
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    return config, model, manager, estimate_memory(config)


def test_weights_and_kv_cache_are_exact(captured):
    config, model, _, estimate = captured
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), model.rope_cos, model.rope_sin])
    assert estimate.parts["weights"] == weights
    assert estimate.parts["kv_cache"] == model.kv_cache.numel() * model.kv_cache.element_size()


def test_buffers_cover_the_packed_staging_buffer(captured):
    _, _, manager, estimate = captured
    assert manager.buffers.nbytes <= estimate.parts["buffers"] <= 4 * manager.buffers.nbytes


def test_each_graph_matches_the_tape_and_the_forward_it_records(captured):
    config, model, manager, estimate = captured
    by_key = {(g.num_tokens, g.num_reqs): g for g in estimate.graphs}
    external = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    external |= {t.untyped_storage().data_ptr() for t in manager.buffers.storage().values()}
    for key, graph in manager.graphs.items():
        guess = by_key[(key.num_tokens, key.num_reqs)]
        peak = graph.tape.peak_bytes
        assert guess.output == graph.memory_bytes - peak  # the static output, exactly
        assert 1.0 <= guess.activations / peak <= 1.3, (key, guess.activations, peak)
        inputs = manager.buffers.stage(dummy_batch(key, max_model_len=config.kv_cache.max_model_len), key)
        with torch.inference_mode(), _Allocations() as mode:
            model.forward(inputs)
        every = sum(t.untyped_storage().nbytes() for p, t in mode.tensors.items() if p not in external)
        assert every <= guess.transient <= every * 1.001, (key, guess.transient, every)  # never below


def test_the_emulated_total_holds_outputs_plus_the_capture_peak_above_them(captured):
    _, _, _, estimate = captured
    assert estimate.parts["graphs"] == sum(g.output for g in estimate.graphs)
    # The largest key is recorded first, beside no output: the peak is at least its transient.
    largest = max(estimate.graphs, key=lambda g: g.num_tokens)
    assert estimate.capture_transient + estimate.parts["graphs"] >= largest.transient
    at_capture = sum(estimate.parts.values()) + estimate.capture_transient
    assert estimate.total == max(at_capture, estimate.parts["weights"] + estimate.build_transient)  # drawn first


SMALL = {"model.hidden_size": 64, "model.num_heads": 4, "model.num_kv_heads": 2, "model.vocab_size": 1000}
SMALL |= {"kv_cache.max_model_len": 256, "kv_cache.num_blocks": 64, "batching.max_num_seqs": 8}
SMALL |= {"capture.mode": "full_decode_only"}  # uniform keys only: two or three graphs per test
PEAKS = {  # each a second or two: the largest recording, the verification or the lm head's draw is the peak
    "fp32, sizes 1 8": {**SMALL, "capture.sizes": [1, 8], "capture.max_size": 8},
    "bf16, 3 layers, long context": {
        **{**SMALL, "capture.sizes": [2, 8], "capture.max_size": 8, "model.dtype": "bfloat16"},
        **{"model.num_layers": 3, "kv_cache.max_model_len": 1024, "kv_cache.block_size": 32},
    },
    "1 layer, vocab 32000, fp16": {
        **{**SMALL, "capture.sizes": [8], "capture.max_size": 8, "model.num_layers": 1},
        **{"model.vocab_size": 32000, "model.num_kv_heads": 1, "model.dtype": "float16"},
    },
    "no verification, decode only": {
        **{**SMALL, "capture.sizes": [1, 4, 8], "capture.max_size": 8},
        **{"checks.verify_replay": False},
    },
    "vocab 32000, probe results kept": {  # uniform and mixed keys: verification beside kept results
        **{**SMALL, "capture.mode": "full", "capture.sizes": [4, 8, 16], "capture.max_size": 16},
        **{"model.num_layers": 1, "model.vocab_size": 32000, "model.num_kv_heads": 1, "batching.max_num_seqs": 16},
    },
}


@pytest.mark.parametrize("overrides", list(PEAKS.values()), ids=list(PEAKS))
def test_the_estimate_is_at_or_within_10_percent_above_the_exact_allocation_peak(overrides):
    # Every byte of torch storage alive at once from the build to the end of capture, from the
    # profiler's allocation events: the estimate is never below it and at most 10% above.
    from graphcap.testing.allocations import allocation_peak

    config = load_config(overrides={"device": "cpu", **overrides})
    real = allocation_peak(lambda: CaptureManager(build_model(config), config, progress=False).capture()).peak
    total = estimate_memory(config).total
    assert real <= total <= 1.1 * real, f"estimate {total} bytes, allocation peak {real} bytes ({total / real:.4f}x)"


def test_canary_without_the_kept_probe_results_the_estimate_is_below_the_peak(monkeypatch):
    from graphcap.memory import estimate as estimate_module
    from graphcap.testing.allocations import allocation_peak

    config = load_config("tiny-cpu-ci", {"device": "cpu"})  # the keys' probes share one token, and more
    real = allocation_peak(lambda: CaptureManager(build_model(config), config, progress=False).capture()).peak
    assert estimate_memory(config).total >= real
    monkeypatch.setattr(estimate_module, "_kept_references", lambda config, registry, order, graphs: None)
    assert estimate_memory(config).total < real  # the kept results are what the peak holds beyond the rest


def test_the_cuda_pool_holds_the_largest_working_set_since_outputs_are_not_kept_alive():
    config = load_config(overrides={"device": "cpu", **SHAPES["default"]})
    estimate = estimate_memory(config, backend="cuda")
    assert estimate.parts["graphs"] == max(g.activations + g.output for g in estimate.graphs)
    # Warmups and verification run eagerly outside the pool: the largest key's working set, or its
    # output's copies while comparing, beside the copy of its last warmup's output verification
    # compares the dummy batch with and the probe results kept then (the real rows of a probe batch's logits,
    # from its first probe while a later key probes it); the pool itself frees into itself while capturing.
    registry = KeyRegistry.from_config(config)
    by_key = dict(zip(registry.planned, estimate.graphs))
    order = registry.capture_order()
    probes = [
        [(probe_identity(registry.capture_shape(key), fill), fill.num_tokens) for fill in probe_fills(
            registry.capture_shape(key), max_model_len=config.kv_cache.max_model_len)]
        for key in order
    ]  # fmt: skip
    first, last, rows = {}, {}, {}
    for index, made in enumerate(probes):
        for identity, tokens in made:
            first.setdefault(identity, index)
            last[identity] = index
            rows[identity] = tokens * config.model.vocab_size * 4  # float32 logits
    verify = 0
    for index, key in enumerate(order):
        graph = by_key[key]
        before = sum(rows[i] for i in first if first[i] < index <= last[i])
        during = before + sum(rows[i] for i in first if first[i] == index < last[i])
        largest = max(tokens for _, tokens in probes[index]) * config.model.vocab_size * 4
        dummy = 2 * graph.output + max(graph.activations, 5 * graph.output) + before
        probe = 2 * graph.output + max(graph.activations, 5 * largest) + during
        verify = max(verify, dummy, probe)
        assert during <= REFERENCE_BYTES
    assert estimate.capture_transient == max(verify, max(g.activations for g in estimate.graphs)) > 0
    off = load_config(overrides={"device": "cpu", **SHAPES["default"], "checks.verify_replay": False})
    assert estimate_memory(off, backend="cuda").capture_transient == max(g.activations for g in estimate.graphs)
    assert estimate.parts["buffers"] > estimate_memory(config).parts["buffers"]  # pinned host + device copy


def test_a_factory_supplies_its_own_estimate_or_is_named_as_unknown():
    config = load_config(overrides={"model.factory": "pkg.mod:make"})
    unknown = estimate_memory(config)
    assert set(unknown.parts) == {"buffers"} and "pkg.mod:make not estimated" in unknown.describe()
    given = estimate_memory(config, model_estimate=lambda c: {"weights": 7 << 30, "kv_cache": 1 << 30})
    assert given.parts["weights"] == 7 << 30 and given.total == (8 << 30) + given.parts["buffers"]
    assert estimate_memory(config, model_estimate=lambda c: 5 << 20).parts["model"] == 5 << 20
    with pytest.raises(ValueError, match=r"estimate_memory of pkg\.mod:make gave weights=-1; expected bytes >= 0"):
        estimate_memory(config, model_estimate=lambda c: {"weights": -1})


def test_largest_part_counts_the_transient_with_what_it_belongs_to():
    estimate = MemoryEstimate("emulated", {"weights": 10, "kv_cache": 30, "graphs": 5}, build_transient=4)
    assert estimate.largest_part() == ("kv_cache", 30)
    assert MemoryEstimate("emulated", {"weights": 10, "graphs": 5}, capture_transient=40).largest_part() == (
        "graphs",
        45,
    )
    assert MemoryEstimate("emulated", {"weights": 10, "graphs": 5}, build_transient=40).largest_part() == (
        "weights",
        50,
    )


def test_available_memory_on_this_host_is_known():
    available, what = available_memory("cpu")
    if not Path("/proc/meminfo").exists() and not hasattr(os, "sysconf"):
        pytest.skip("no way to ask this OS")
    assert available is not None and available > 0 and what


ENGINE_BUFFERS = [
    {"name": "mrope", "rows": "tokens", "shape": [3], "dtype": "int64", "row_dim": 1},
    {"name": "temperature", "rows": "reqs", "dtype": "float32", "pad": 1.0},
    {"name": "lora_table", "rows": "none", "shape": [5, 7], "dtype": "int16"},
    {"name": "mask", "rows": "tokens", "dtype": "bool"},
]


def _with_buffers(buffers):
    import yaml

    from graphcap.config import config_from_text

    return config_from_text(yaml.safe_dump({"device": "cpu", "buffers": buffers}))


@pytest.mark.parametrize("backend", ["emulated", "cuda"])
def test_engine_buffers_are_in_the_estimate_byte_for_byte(backend):
    from graphcap.inputs import BufferSpec
    from graphcap.staging import PersistentBuffers

    plain = load_config(overrides={"device": "cpu"})
    config = _with_buffers(ENGINE_BUFFERS)
    added = (
        estimate_memory(config, backend=backend).parts["buffers"]
        - estimate_memory(plain, backend=backend).parts["buffers"]
    )
    staged = PersistentBuffers.from_config(config, extras=[BufferSpec.from_config(b) for b in config.buffers]).nbytes
    staged_plain = PersistentBuffers.from_config(plain).nbytes
    copies = 2 if backend == "cuda" else 1  # pinned host staging and its device copy
    assert added == copies * (staged - staged_plain) > 0
    # The same buffers given to CaptureManager(buffers=...) instead of the config: the same bytes.
    specs = [BufferSpec(**{k: tuple(v) if k == "shape" else v for k, v in b.items()}) for b in ENGINE_BUFFERS]
    assert (
        estimate_memory(plain, backend=backend, buffers=specs).parts["buffers"]
        == (estimate_memory(config, backend=backend).parts["buffers"])
    )


def test_a_buffer_no_machine_holds_is_refused_by_the_estimate_with_exit_2(tmp_path, capsys):
    # T x 2**40 float64 (shape [2**20, 2**20] per token): 2 PiB, once shown as "buffers 1.6 KiB".
    from graphcap.cli import main

    huge = [{"name": "huge", "rows": "tokens", "shape": [1 << 20, 1 << 20], "dtype": "float64"}]
    config = _with_buffers(huge)
    assert estimate_memory(config).parts["buffers"] > config.batching.max_num_tokens * 8 << 40
    path = tmp_path / "huge.yaml"
    path.write_text(
        "device: cpu\nbuffers:\n  - {name: huge, rows: tokens, shape: [1048576, 1048576], dtype: float64}\n"
    )
    assert main(["capture", "--config", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "buffers 2048.0 TiB" in err.splitlines()[0]
    assert err.splitlines()[-1].startswith("graphcap capture: error: the memory estimate 2048.0 TiB does not fit")
    assert "the largest part is buffers 2048.0 TiB, sized by batching.max_num_tokens" in err
    assert "and the buffers: list" in err


@pytest.mark.parametrize(("backend", "name"), [("cuda", "graph pool"), ("emulated", "graph outputs")])
def test_the_graphs_part_has_one_name_per_backend(backend, name):
    line = estimate_memory(load_config(overrides={"device": "cpu"}), backend=backend).describe()
    assert f", {name} " in line and "graphs " not in line
