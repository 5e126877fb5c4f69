"""The fastest callable that runs a recorded aten overload exactly as recorded.

Calling an `OpOverload` goes through the boxed dispatcher path (about 1.5 us more per op
than the native Python bindings on CPU). For each recorded op the tape asks
`native_binding` for the binding that reaches the very same overload with the very same
arguments, and falls back to the `OpOverload` when none does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["native_binding", "signature"]

# Where torch keeps its native (C++) Python bindings. `TensorBase` holds only C methods,
# so Python-level wrappers in torch/_tensor.py (Tensor.split, ...) are never picked.
_BINDING_NAMESPACES = (
    torch._C._VariableFunctions,
    torch._C._nn,
    # torch's stubs (torch/_C/__init__.pyi) do not declare these submodules; they exist in every build.
    torch._C._special,  # type: ignore[attr-defined]
    torch._C._linalg,  # type: ignore[attr-defined]
    torch._C._fft,  # type: ignore[attr-defined]
    torch._C.TensorBase,
)


class _ProbeStop(Exception):
    """Raised by `_Probe` at the dispatcher, before any kernel runs."""


class _Probe(TorchDispatchMode):
    """Records the overload (and arguments) a call reaches first, then stops the call."""

    seen: tuple[Any, tuple, dict] | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no dynamo wrapper (see `UnsafeOpMode`): nothing is compiled inside a probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen = (func, args, kwargs or {})
        raise _ProbeStop


def native_binding(func: Any, args: tuple, kwargs: dict) -> Callable | None:
    """The native binding that dispatches `func(*args, **kwargs)` to `func` itself, or None.

    A candidate is called under `_Probe`, which stops it at the dispatcher: no kernel runs
    and no in-place write happens twice. It is kept only if the dispatcher saw the same
    overload with the same arguments; otherwise the step calls the (slower, boxed)
    `OpOverload`. The answer is kept per overload and argument signature (`signature`), so a tape
    compiled for another key, or again in a later pass, probes no op it has seen.
    """
    try:
        shape = signature(func, args, kwargs)
    except TypeError:  # an unhashable constant: probe without the cache
        shape = None
    if shape is not None:
        known = _found.get(shape)
        if known is not None and known[0] is func:
            return known[1]
    namespace, _, name = func._schema.name.partition("::")
    found = _probe_bindings(func, name, args, kwargs) if namespace == "aten" else None
    if shape is not None:
        _found[shape] = (func, found)
    return found


def signature(func: Any, args: tuple, kwargs: dict) -> tuple[object, ...]:
    """The cache key of `native_binding`: the overload (by identity) and what the argument parser sees of each
    argument (`_signature`). `TypeError` for an unhashable constant."""
    sig: tuple[object, ...] = (id(func), tuple([_signature(v) for v in args]))
    if kwargs:
        sig += tuple([(k, _signature(v)) for k, v in kwargs.items()])
    hash(sig)  # TypeError for an unhashable constant, before the key is used
    return sig


_found: dict[tuple, tuple[Any, Callable | None]] = {}
"""(overload, binding) found for an overload and the types of its arguments: the Python argument parser picks the
overload from the types alone (a zero-dimensional tensor may stand for a number, so that is part of the
type), so one probe answers every later call with the same types. Keyed by the overload's `id` (an
`OpOverload` hashes in Python, on every op); the overload kept beside the binding is compared by identity,
so an id reused by another object never answers for it."""

_NUMBERS = frozenset({bool, int, float, complex})


def _signature(value: Any) -> Any:
    """What the argument parser sees of `value`: a tensor's type and whether it has no dimensions, a number's
    type, a sequence's element signatures; any other constant (dtype, device, str, None) itself."""
    kind = type(value)
    if kind in _NUMBERS:
        return kind
    if isinstance(value, torch.Tensor):
        return (kind, value.dim() == 0)
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        return (kind, tuple([_signature(v) for v in value]))
    return (kind, value)


def _probe_bindings(func: Any, name: str, args: tuple, kwargs: dict) -> Callable | None:
    for owner in _BINDING_NAMESPACES:
        candidate = getattr(owner, name, None)
        if candidate is None:
            continue
        probe = _Probe()
        try:
            with probe:
                candidate(*args, **kwargs)
        except _ProbeStop:
            pass
        except Exception:  # this binding rejects the signature: try the next one
            continue
        seen = probe.seen
        if seen is not None and seen[0] is func and _same(seen[1:], (args, kwargs)):
            return candidate
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal arguments: tensors by identity, sequences and mappings element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
