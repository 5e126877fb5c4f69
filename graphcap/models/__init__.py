"""Reference models and `build_model`, which turns `config.model` into a model on a device.

A model is anything with `forward(inputs: ForwardInputs) -> logits [T, vocab]`. Built in:
`tiny-llama` (`TinyLlama`, a Llama-style decoder over a paged KV cache). Your own model
comes from `model.factory: "pkg.module:function"`, called with the `CaptureConfig`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from graphcap.backends import resolve_device
from graphcap.config import CaptureConfig
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.models.llama import TinyLlama
from graphcap.models.reference import dense_reference

__all__ = ["MODELS", "TinyLlama", "build_model", "dense_reference", "resolve_device"]

MODELS: Mapping[str, Callable[[CaptureConfig, torch.device], nn.Module]] = MappingProxyType({"tiny-llama": TinyLlama})
"""Built-in models: `model.name` -> builder(config, device). Must match `config.BUILTIN_MODELS`."""


def build_model(config: CaptureConfig, device: torch.device | str | None = None) -> nn.Module:
    """The model `config.model` names, on `device` (None: `resolve_device(config)`).

    A built-in model is built directly on the device with its KV cache sized from
    `config.kv_cache`. A factory is imported and called as `factory(config)`; when it
    returns an `nn.Module`, the module is then moved to the device (a no-op if it is
    already there). Raises `ConfigError` (key `model.factory`) when the factory cannot be
    imported, is not callable, or returns something without a callable `forward`.
    Exceptions raised inside the factory itself propagate unchanged.
    """
    device = resolve_device(config) if device is None else torch.device(device)
    spec = config.model.factory
    if spec is None:
        builder = MODELS.get(config.model.name)
        if builder is None:
            raise _error("model.name", f"unknown model {config.model.name!r}; built in: {', '.join(MODELS)}")
        return builder(config, device)
    model = _load_factory(spec)(config)
    if not callable(getattr(model, "forward", None)):
        raise _error(
            "model.factory",
            f"{spec} returned {_describe(model)}, which has no callable forward(inputs); "
            "return the model (e.g. an nn.Module)",
        )
    if isinstance(model, nn.Module):
        model = model.to(device)
    return model


def _load_factory(spec: str) -> Callable[[CaptureConfig], object]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own import-time error, shown with its type
        raise _error(
            "model.factory",
            f"cannot import module {module_name!r} of {spec!r}: {type(exc).__name__}: {exc}; "
            "check the module path and that its package is on sys.path",
        ) from exc
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        shown = ", ".join(public[:10]) + (", ..." if len(public) > 10 else "") or "none"
        raise _error(
            "model.factory", f"module {module_name!r} has no attribute {attr!r} (from {spec!r}); its callables: {shown}"
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise _error(
            "model.factory", f"{spec} is {_describe(factory)}, not callable; point it at a function (config) -> model"
        )
    return factory


def _error(key: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(key, message)])


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
