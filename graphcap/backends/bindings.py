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

__all__ = ["native_binding"]

# Where torch keeps its native (C++) Python bindings. `TensorBase` holds only C methods,
# so Python-level wrappers in torch/_tensor.py (Tensor.split, ...) are never picked.
_BINDING_NAMESPACES = (
    torch._C._VariableFunctions,
    torch._C._nn,
    torch._C._special,
    torch._C._linalg,
    torch._C._fft,
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
    `OpOverload`.
    """
    namespace, _, name = func._schema.name.partition("::")
    if namespace != "aten":
        return None
    try:
        shape = (func, _signature(args), tuple((k, _signature(v)) for k, v in kwargs.items()))
        known = _found.get(shape, _UNKNOWN)
    except TypeError:  # an unhashable constant: probe without the cache
        shape, known = None, _UNKNOWN
    if known is not _UNKNOWN:
        return known
    found = _probe_bindings(func, name, args, kwargs)
    if shape is not None:
        _found[shape] = found
    return found


_UNKNOWN = object()
_found: dict[Any, Callable | None] = {}
"""The binding found for an overload and the types of its arguments: the Python argument parser picks the
overload from the types alone (a zero-dimensional tensor may stand for a number, so that is part of the
type), so one probe answers every later call with the same types."""


def _signature(value: Any) -> Any:
    """What the argument parser sees of `value`: a tensor's type and whether it has no dimensions, a number's
    type, a sequence's element signatures; any other constant (dtype, device, str, None) itself."""
    if isinstance(value, torch.Tensor):
        return (type(value), value.dim() == 0)
    if isinstance(value, (bool, int, float, complex)):
        return type(value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_signature(v) for v in value))
    hash(value)  # TypeError for an unhashable constant
    return (type(value), value)


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
