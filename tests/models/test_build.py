"""build_model and resolve_device: built-in registry, factories by dotted path, clear errors."""

from __future__ import annotations

import pytest
import torch

from graphcap.batch import StepBatch
from graphcap.config import BUILTIN_MODELS, ConfigError, load_config
from graphcap.keys import GraphKey
from graphcap.models import MODELS, TinyLlama, build_model, resolve_device
from graphcap.staging import PersistentBuffers

from . import factory_fixture

# The fixture's import name depends on how pytest put tests/ on sys.path; ask it.
FIXTURE = factory_fixture.__name__


def _config(**overrides):
    return load_config(overrides={"device": "cpu", **overrides})


def _factory_config(spec: str):
    return _config(**{"model.name": None, "model.factory": spec})


def test_registry_matches_config_builtin_models():
    assert set(MODELS) == set(BUILTIN_MODELS)


def test_builtin_model_is_built_on_the_resolved_device():
    model = build_model(_config())
    assert isinstance(model, TinyLlama)
    assert model.embed.device.type == "cpu"
    assert model.kv_cache.device.type == "cpu"


def test_auto_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(_config(device="auto")) == torch.device("cpu")


def test_cuda_without_cuda_is_a_config_error_on_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"device: 'cuda' requested but CUDA is not available.*use device: cpu or auto"
    ) as exc:
        build_model(_config(device="cuda"))
    assert [p.key for p in exc.value.problems] == ["device"]


def test_cuda_index_beyond_visible_gpus_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"device: 'cuda:3' names GPU 3 but 1 visible"):
        resolve_device(_config(device="cuda:3"))


def test_factory_is_imported_by_dotted_path_and_called_with_the_config():
    config = _factory_config(f"{FIXTURE}:make_bigram")
    model = build_model(config)
    assert isinstance(model, factory_fixture.Bigram)
    buffers = PersistentBuffers.from_config(config)
    logits = model(buffers.stage(StepBatch([2], [2], [3, 4]), GraphKey(4, 2, False)))
    assert logits.shape == (4, config.model.vocab_size)


def test_factory_module_that_cannot_be_imported_is_named():
    with pytest.raises(
        ConfigError, match=r"model.factory: cannot import module 'no_such_pkg.models'.*ModuleNotFoundError"
    ) as exc:
        build_model(_factory_config("no_such_pkg.models:make"))
    assert [p.key for p in exc.value.problems] == ["model.factory"]


def test_factory_missing_attribute_is_named_with_the_module_callables():
    with pytest.raises(
        ConfigError, match=r"model.factory: module '.*factory_fixture' has no attribute 'make_nothing'.*make_bigram"
    ):
        build_model(_factory_config(f"{FIXTURE}:make_nothing"))


def test_factory_that_is_not_callable_is_refused():
    with pytest.raises(ConfigError, match=r"model.factory: .*:NOT_CALLABLE is int 42, not callable"):
        build_model(_factory_config(f"{FIXTURE}:NOT_CALLABLE"))


@pytest.mark.parametrize("name", ["make_junk", "make_no_forward"])
def test_factory_returning_no_callable_forward_is_refused(name):
    with pytest.raises(ConfigError, match=rf"model.factory: .*:{name} returned .*no callable forward\(inputs\)"):
        build_model(_factory_config(f"{FIXTURE}:{name}"))


def test_factory_gets_its_options_untouched_and_the_resolved_device():
    config = _config(
        **{
            "model.name": None,
            "model.factory": f"{FIXTURE}:make_configured",
            "model.options": {"scale": 0.5, "width": 12, "nested": {"any": ["yaml", 1]}},
        }
    )
    model = build_model(config)
    assert isinstance(model, factory_fixture.Configured)
    assert model.scale == 0.5 and model.table.shape[1] == 12 and model.built_on == torch.device("cpu")
    assert config.model.options["nested"] == {"any": ["yaml", 1]}


def test_a_factory_model_is_not_held_to_the_builtin_models_shape_rules():
    # 100 wide with 3 heads is no Llama the reference model could build; a factory's model may be anything.
    config = _config(**{"model.name": None, "model.factory": f"{FIXTURE}:make_bigram", "model.hidden_size": 100,
                        "model.num_heads": 3})  # fmt: skip
    assert build_model(config).table.shape[0] == config.model.vocab_size
    with pytest.raises(ConfigError, match=r"model\.num_heads: hidden_size 100 is not divisible by num_heads 3"):
        _config(**{"model.hidden_size": 100, "model.num_heads": 3})  # the built-in model: still checked


@pytest.mark.parametrize(
    ("options", "match"),
    [([1, 2], r"model\.options: expected a mapping"), ({1: 2}, r"model\.options: keys must be strings")],
)
def test_model_options_must_be_a_mapping_with_string_keys(options, match):
    with pytest.raises(ConfigError, match=match):
        _config(**{"model.options": options})


def test_a_factory_that_calls_build_model_wraps_the_builtin_model_built_from_its_config():
    from graphcap import CaptureManager

    config = _config(**{"model.name": None, "model.factory": f"{FIXTURE}:make_wrapped", "model.options": {"scale": 3}})
    model = build_model(config)
    assert isinstance(model, factory_fixture.WithScale) and isinstance(model.inner, TinyLlama)
    assert model.inner.kv_cache_num_blocks == config.kv_cache.num_blocks
    plain = build_model(_config())  # the same shape keys and seed: the same weights
    torch.testing.assert_close(model.inner.embed, plain.embed)
    manager = CaptureManager(model, config, progress=False)
    assert all(record.verified for record in manager.capture().records)
    batch = StepBatch([1, 1], [3, 5], [7, 9], [[1], [2]])
    replayed = manager.execute(batch).clone()
    assert manager.last_key in manager.graphs
    torch.testing.assert_close(replayed, 3 * manager.model.inner(manager.buffers.stage(batch, manager.last_key))[:2])


def test_a_factory_wrapping_the_builtin_model_with_shape_keys_it_refuses_is_told_which():
    config = _config(**{"model.name": None, "model.factory": f"{FIXTURE}:make_wrapped", "model.num_heads": 3})
    with pytest.raises(
        ConfigError,
        match=r"model\.factory: .*:make_wrapped asked build_model\(config\) for the built-in tiny-llama model it wraps, "
        r"but the config's model keys do not describe one \(model\.num_heads: hidden_size 256 is not divisible by "
        r"num_heads 3; model\.num_kv_heads: num_heads 3 is not divisible by num_kv_heads 2\); fix them",
    ):
        build_model(config)


def test_a_factory_sees_the_resolved_device_never_auto_and_its_module_is_moved_there():
    factory_fixture.SEEN_DEVICES.clear()
    config = _config(**{"device": "auto", "model.name": None, "model.factory": f"{FIXTURE}:make_seeing"})
    model = build_model(config)
    assert factory_fixture.SEEN_DEVICES == [str(resolve_device(config))] == ["cpu"]  # no CUDA here
    assert model.table.device == resolve_device(config)
    build_model(_config(**{"device": "cpu", "model.name": None, "model.factory": f"{FIXTURE}:make_seeing"}))
    assert factory_fixture.SEEN_DEVICES[-1] == "cpu"
