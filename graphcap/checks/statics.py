"""What a model reaches: every tensor a captured graph reads in place, with the slot it lives in.

A CUDA graph reads each static tensor at the address, shape and strides it had at capture.
`StaticGuard` checks them around every replay; this module lists them. Each comes with its
*slot*, the container and key through which the model reaches it (`module._parameters["w"]`,
`runner.__dict__["lm_head"]`, `caches[0]`), so that an object replaced in its slot is seen as
well as a storage swapped under the same object. The objects on the way (submodules, plain
objects, lists) are slots too: replacing `runner.inner` is a move of everything under it.

| the model is | what it reaches |
|---|---|
| an `nn.Module` | its parameters and buffers (`model.<path>`) and its submodules |
| anything else | its tensor and `nn.Module` attributes (each module's whole tree), and the tensors and modules |
| | in the lists, tuples, dicts and plain objects among its attributes, to depth 4 |
| either | `register_static` tensors (`static.<name>`), graphcap's staging, and the base of any view |
| | among them (`<name>._base`) |

Not reached: tensors kept only in closures, globals, `__slots__` or objects of graphcap's own
classes (a `CaptureManager` the model holds), and a module's plain tensor attributes; the ones a graph
reads are found from its recording instead (`graphcap.checks.recorded`, named through `held_tensors`,
which walks modules' plain attributes too), the rest can be registered (`CaptureManager.register_static`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import FunctionType, MethodType, ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["MAX_DEPTH", "Reached", "held_tensors", "reach", "reached_modules"]

MAX_DEPTH = 4
"""How deep the walk of a non-Module model goes through plain objects and containers."""
_SKIP_TYPES = (type, ModuleType, FunctionType, MethodType, str, bytes, int, float, bool)


class Reached(NamedTuple):
    """One thing a model reaches: a tensor the graph reads, or an object on the way to one."""

    name: str
    """Dotted name in errors: `model.layers.0.weight`, `static.kv_cache.0`, `model.caches.1`."""
    value: Any
    """The tensor (or the module, list or plain object on the way) at capture."""
    container: Any
    """Where it lives: the dict, list or tuple that `key` indexes; None when nothing can replace it."""
    key: Any
    what: str
    """What to call it in an error: parameter, buffer, submodule, attribute, item, static input."""


def reach(model: Any, registered: Mapping[str, torch.Tensor], staging: Mapping[str, torch.Tensor]) -> list[Reached]:
    """Everything `model` reaches (see the module table): staging first, then registered, then the model's.

    Tensors without storage of their own are listed like any other: `StaticGuard` names them.
    """
    found = [Reached(name, t, None, None, "static input") for name, t in staging.items()]
    found += [Reached(f"static.{n}", t, registered, n, "static input") for n, t in registered.items()]
    if isinstance(model, nn.Module):
        found += _module_tree(model, "model")
    else:
        found += _walk(model, "model", 0, {id(model)})
    bases = []
    seen = {id(r.value) for r in found}
    for r in found:
        base = r.value._base if isinstance(r.value, torch.Tensor) else None
        if base is not None and id(base) not in seen:  # the forward may read the whole base
            seen.add(id(base))
            bases.append(Reached(f"{r.name}._base", base, None, None, "static input"))
    return found + bases


def reached_modules(model: Any, found: list[Reached]) -> dict[int, tuple[str, nn.Module]]:
    """id -> (dotted path, module) of `model` (when a module) and every module in `found` (from `reach`)."""
    modules = {id(model): ("model", model)} if isinstance(model, nn.Module) else {}
    for r in found:
        if isinstance(r.value, nn.Module):
            modules.setdefault(id(r.value), (r.name, r.value))
    return modules


def _module_tree(module: nn.Module, path: str) -> list[Reached]:
    found = []
    for name, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{path}.{name}" if name else path
        for local, param in sub._parameters.items():
            if param is not None:
                found.append(Reached(f"{prefix}.{local}", param, sub._parameters, local, "parameter"))
        for local, buffer in sub._buffers.items():
            if buffer is not None:
                found.append(Reached(f"{prefix}.{local}", buffer, sub._buffers, local, "buffer"))
        for local, child in sub._modules.items():
            if child is not None:
                found.append(Reached(f"{prefix}.{local}", child, sub._modules, local, "submodule"))
    return found


def _walk(obj: Any, path: str, depth: int, seen: set[int]) -> list[Reached]:
    """Tensors and modules among `obj`'s attributes and items, and the objects on the way to them."""
    found = []
    for container, key, name, what, value in _children(obj, path):
        if id(value) in seen or isinstance(value, _SKIP_TYPES) or value is None:
            continue
        if isinstance(value, torch.Tensor):
            found.append(Reached(name, value, container, key, what))
        elif isinstance(value, nn.Module):
            seen.add(id(value))
            found.append(Reached(name, value, container, key, what))
            found += _module_tree(value, name)
        elif depth < MAX_DEPTH and _is_walked(value):
            seen.add(id(value))
            below = _walk(value, name, depth + 1, seen)
            if below:  # an object on the way to a tensor: replacing it moves what is below
                found.append(Reached(name, value, container, key, what))
                found += below
    return found


def _children(obj: Any, path: str) -> Iterator[tuple[Any, Any, str, str, Any]]:
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield obj, i, f"{path}.{i}", "item", value
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield obj, key, f"{path}.{key}", "item", value
    else:
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            for key, value in list(attributes.items()):
                yield attributes, key, f"{path}.{key}", "attribute", value


def _is_walked(value: Any) -> bool:
    """Containers and plain objects with attributes; never graphcap's own objects (a manager the model holds)."""
    if isinstance(value, (list, tuple, dict)):
        return True
    module = type(value).__module__ or ""
    own = module.startswith("graphcap.") and not module.startswith(("graphcap.models", "graphcap.testing"))
    return isinstance(getattr(value, "__dict__", None), dict) and not own and not module.startswith("torch")


def held_tensors(model: Any, path: str = "model") -> dict[int, Reached]:
    """id -> where `model` keeps each tensor it holds, by the first path found, for naming a tensor seen elsewhere
    (`graphcap.checks.recorded`) and finding KV caches (`graphcap.capture.restore`).

    Wider than `reach`: the plain attributes of every module too (nano-vllm's `Attention.k_cache`, a tensor set
    on a module that is no registered buffer), with lists, tuples, dicts and plain objects among them to
    `MAX_DEPTH` levels below each module. Names read as Python: `model.layers[3].attn.k_cache`,
    `model.caches[0]`, `model.state['kv']`.
    """
    found: dict[int, Reached] = {}
    _hold(model, path, 0, {id(model)}, found)
    return found


def _hold(obj: Any, path: str, depth: int, seen: set[int], found: dict[int, Reached]) -> None:
    if isinstance(obj, nn.Module):
        slots: list[tuple[dict[str, Any], str]] = [
            (obj._parameters, "parameter"),
            (obj._buffers, "buffer"),
            (obj._modules, "submodule"),
        ]
        items = [(d, k, _attribute(path, k), what, v) for d, what in slots for k, v in d.items()]
        own = obj.__dict__
        items += [(own, k, f"{path}.{k}", "attribute", v) for k, v in list(own.items()) if k not in _MODULE_SLOTS]
        below = 0  # a module's attributes start a fresh depth
    else:
        items = [(c, k, _item(path, obj, k), what, v) for c, k, _, what, v in _children(obj, path)]
        below = depth + 1
    for container, key, name, what, value in items:
        if value is None or isinstance(value, _SKIP_TYPES) or id(value) in seen:
            continue
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), Reached(name, value, container, key, what))
        elif isinstance(value, nn.Module) or (below <= MAX_DEPTH and _is_walked(value)):
            seen.add(id(value))
            _hold(value, name, below, seen, found)


_MODULE_SLOTS = frozenset(("_parameters", "_buffers", "_modules"))


def _attribute(path: str, key: str) -> str:
    return f"{path}[{key}]" if key.isdigit() else f"{path}.{key}"


def _item(path: str, obj: Any, key: Any) -> str:
    if isinstance(obj, (list, tuple)):
        return f"{path}[{key}]"
    if isinstance(obj, dict):
        return f"{path}[{key!r}]"
    return f"{path}.{key}"
