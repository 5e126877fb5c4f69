"""Reference models and `build_model`, which turns `config.model` into a model on a device.

A model is anything with `forward(inputs: ForwardInputs) -> logits [T, vocab]`. Built in:
`tiny-llama` (`TinyLlama`, a Llama-style decoder over a paged KV cache). Your own model
comes from `model.factory: "pkg.module:function"`, called with the `CaptureConfig`.

To wrap the built-in model (add a head, a LoRA, an adapter), a factory calls `build_model(config)`
with the config it was given: while a factory runs, `build_model` of a config naming that same
factory builds the built-in `tiny-llama` from the config's `model` shape keys and `kv_cache` (checked
by the built-in model's shape rules), instead of calling the factory again:

    def make_wrapped(config):
        return WithAdapter(build_model(config))  # the built-in model inside

Trust: a config that names a factory runs that code, as a Python script would; load configs
only from people you would take a script from. The factory's module is found on `sys.path`,
then in the directory of the config file that names it, then in the current directory (both
searched after `sys.path`, so a file there never shadows an installed package), the same way
for the `graphcap` console script, `python -m graphcap` and a library call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Protocol, cast

import torch
from torch import nn

from graphcap.backends import resolve_device
from graphcap.config import BUILTIN_MODELS, CaptureConfig
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.models.llama import TinyLlama
from graphcap.models.reference import dense_reference
from graphcap.models.window import WindowedMemory, window_reference

__all__ = [
    "MODELS",
    "Model",
    "TinyLlama",
    "WindowedMemory",
    "build_model",
    "dense_reference",
    "load_factory",
    "resolve_device",
    "window_reference",
]


class Model(Protocol):
    """What `build_model` returns: an object with `forward(inputs)` (a built-in model, or a factory's, usually an
    `nn.Module`)."""

    def forward(self, inputs: Any) -> Any: ...


MODELS: Mapping[str, Callable[[CaptureConfig, torch.device], nn.Module]] = MappingProxyType({"tiny-llama": TinyLlama})
"""Built-in models: `model.name` -> builder(config, device). Must match `config.BUILTIN_MODELS`."""

_RUNNING: ContextVar[frozenset[str]] = ContextVar("graphcap_factories_running", default=frozenset())
"""The factories (`model.factory` specs) `build_model` is inside of, on this thread."""


def build_model(config: CaptureConfig, device: torch.device | str | None = None) -> Model:
    """The model `config.model` names, on `device` (None: `resolve_device(config)`).

    A built-in model is built directly on the device with its KV cache sized from
    `config.kv_cache`. A factory (see `load_factory`) is called as `factory(config)`, or as
    `factory(config, device=device)` when it takes a `device` parameter (so it can build its
    weights there); its own settings are in `config.model.options`. The config it is given names
    the resolved device (`config.device` `auto` becomes `cpu` or `cuda`). When it returns an
    `nn.Module`, the module is then moved to the device (a no-op if it is already there): `build_model`
    moves the models it builds; `CaptureManager` never moves a model (one elsewhere is a `ConfigError`).
    Raises `ConfigError` (key `model.factory`) when the factory cannot be imported, is not
    callable, or returns something without a callable `forward`.
    Exceptions raised inside the factory itself propagate unchanged.

    Called from inside the factory a config names (the factory wraps the built-in model), it
    builds the built-in model from that config's shape keys instead (see the module doc).
    """
    device = resolve_device(config) if device is None else torch.device(device)
    spec = config.model.factory
    if spec is not None and spec in _RUNNING.get():
        config, spec = _builtin_of(config), None
    if spec is None:
        builder = MODELS.get(config.model.name or "")
        if builder is None:
            raise _error("model.name", f"unknown model {config.model.name!r}; built in: {', '.join(MODELS)}")
        return builder(config, device)
    factory = load_factory(spec, beside=config.source)
    if config.device == "auto":  # the factory sees the device it is built for, never the literal 'auto'
        config = dataclasses.replace(config, device=str(device))
    kwargs = {"device": device} if _takes_device(factory) else {}
    running = _RUNNING.set(_RUNNING.get() | {spec})  # its own build_model(config) builds the built-in model
    try:
        with _searched_last(_search_dirs(config.source)):  # the factory may import its siblings as it runs
            model = factory(config, **kwargs)
    finally:
        _RUNNING.reset(running)
    if not callable(getattr(model, "forward", None)):
        raise _error(
            "model.factory",
            f"{spec} returned {_describe(model)}, which has no callable forward(inputs); "
            "return the model (e.g. an nn.Module)",
        )
    if isinstance(model, nn.Module):
        model = model.to(device)
    return cast(Model, model)  # it has a callable forward (checked above)


def _builtin_of(config: CaptureConfig) -> CaptureConfig:
    """`config` naming the built-in model instead of its factory; `ConfigError` (keys `model.*`) when its
    shape keys break the built-in model's rules (a factory model is not held to them)."""
    try:
        model = dataclasses.replace(config.model, factory=None, name=BUILTIN_MODELS[0])
    except ConfigError as exc:
        shown = "; ".join(f"{p.key}: {p.message}" for p in exc.problems)
        raise _error(
            "model.factory",
            f"{config.model.factory} asked build_model(config) for the built-in {BUILTIN_MODELS[0]} model it wraps, "
            f"but the config's model keys do not describe one ({shown}); fix them, or build the inner model yourself",
        ) from None
    return dataclasses.replace(config, model=model)


def _takes_device(factory: Callable) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: call it with the config alone
        return False
    return any(p.name == "device" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def load_factory(spec: str, *, beside: str | os.PathLike | None = None) -> Callable[[CaptureConfig], object]:
    """The factory function `spec` (`"pkg.module:function"`) names, imported but not called.

    Its module is found on `sys.path`, then in the directory of the config file `beside` (for
    a config, `config.source`), then in the current directory. The function may carry an
    `estimate_memory(config)` attribute (see `graphcap.memory.estimate`). Raises `ConfigError` (key
    `model.factory`) when the module cannot be imported (the message says where it looked) or
    the attribute is missing or not callable.
    """
    module_name, _, attr = spec.partition(":")
    dirs = _search_dirs(beside)
    try:
        with _searched_last(dirs):
            module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own import-time error, shown with its type
        looked = " and ".join(f"in {d} ({why})" for d, why in dirs)
        raise _error(
            "model.factory",
            f"cannot import module {module_name!r} of {spec!r}: {type(exc).__name__}: {exc}; looked on sys.path, "
            f"then {looked}: check the module path, or put its package on sys.path (PYTHONPATH)",
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


def _search_dirs(config_file: str | os.PathLike | None) -> list[tuple[str, str]]:
    """Where factory modules are looked for after `sys.path`, in order: (directory, why)."""
    dirs = []
    if config_file is not None:
        dirs.append((os.path.dirname(os.path.abspath(config_file)), "beside the config file"))
    cwd = os.getcwd()
    if all(d != cwd for d, _ in dirs):
        dirs.append((cwd, "the current directory"))
    return dirs


@contextlib.contextmanager
def _searched_last(dirs: list[tuple[str, str]]) -> Iterator[None]:
    """Append `dirs` to `sys.path` for the duration (those not there already).

    `python -m` puts the current directory first on `sys.path` and a console script does not;
    `graphcap.__main__` drops it, and this puts it back last for factory modules only.
    """
    added = []
    for directory, _ in dirs:
        if not any(os.path.abspath(entry or ".") == directory for entry in sys.path):
            sys.path.append(directory)
            added.append(directory)
    try:
        yield
    finally:
        for directory in added:
            with contextlib.suppress(ValueError):  # the factory removed it itself
                sys.path.remove(directory)


def _error(key: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(key, message)])


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
