"""The engine's random-number generators and CUDA graphs: registered before capture, named when missing.

A CUDA graph replays random ops (sampling, dropout-style noise in a draft model) with the
generator's state advanced on every replay only if the generator is registered with the graph
before `capture_begin`. The device's default CUDA generator is registered by torch itself; any
other `torch.Generator` (an engine's per-request or per-sampler generator) must be given to
graphcap: `CaptureManager(..., generators=[g])` or `get_backend(..., generators=[g])`. The CUDA
backend then calls `CUDAGraph.register_generator_state(g)` on every graph and every piece before
its capture begins (feature-detected: torch without that method refuses `generators=` when the
backend is made). Without it, torch 2.11 raises "Attempt to increase offset for a CUDA generator
not in capture mode" at capture; the preflight names the op and line first
(`unregistered_generator`). After a capture CUDA invalidated, the backend takes the default and the
registered generators out of capture mode again (`graphcap.backends.cuda_recovery.restore_generators`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "check_generators",
    "register_generators",
    "registered",
    "supports_generator_registration",
    "unregistered_generator",
]

_REGISTERED: contextvars.ContextVar[tuple[torch.Generator, ...]] = contextvars.ContextVar(
    "graphcap_generators", default=()
)

REASON = (
    "it draws from a CUDA generator that is neither the device's default generator nor registered with the "
    "graph; capture would fail ('Attempt to increase offset for a CUDA generator not in capture mode') or "
    "replay a frozen random state"
)
FIX = (
    "Give the generator to graphcap before capture: CaptureManager(..., generators=[g]) "
    "(get_backend(..., generators=[g]); check_capture_safe(fn, device, generators=[g]))"
)


def check_generators(generators: Any, device: torch.device | str, where: str = "generators") -> tuple:
    """The generators as a tuple, every one checked: `TypeError` / `ValueError` naming `where[i]`.

    Each must be a `torch.Generator` of `device`'s type (and index, where both name one): the graphs
    run on `device`, a generator of another device cannot feed them.
    """
    device = torch.device(device)
    if isinstance(generators, torch.Generator) or not isinstance(generators, Iterable):
        raise TypeError(
            f"{where} must be a list of torch.Generator (e.g. [g]); got {type(generators).__name__}: "
            "wrap a single generator in a list"
        )
    found = tuple(generators)
    for i, generator in enumerate(found):
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"{where}[{i}] must be a torch.Generator; got {type(generator).__name__}")
        own = generator.device
        if own.type != device.type or (own.index is not None and device.index not in (None, own.index)):
            raise ValueError(
                f"{where}[{i}] is a generator of {own}, but the graphs run on {device}: give generators of "
                f"{device} (torch.Generator(device='{device}'))"
            )
    return found


def supports_generator_registration() -> bool:
    """Whether this torch's `CUDAGraph` has `register_generator_state`."""
    return hasattr(torch.cuda.CUDAGraph, "register_generator_state")


def register_generators(graph: Any, generators: Iterable[torch.Generator]) -> None:
    """Register each generator's state with `graph`; call before `graph.capture_begin`."""
    for generator in generators:
        graph.register_generator_state(generator)


@contextlib.contextmanager
def registered(generators: Iterable[torch.Generator]) -> Iterator[None]:
    """The preflight inside knows `generators` as registered (they are registered at capture)."""
    token = _REGISTERED.set(tuple(generators))
    try:
        yield
    finally:
        _REGISTERED.reset(token)


def unregistered_generator(kwargs: dict) -> torch.Generator | None:
    """The CUDA generator a call was given (`generator=`) that capture would not know, or None.

    Not the device's default CUDA generator (torch registers it) and not among `registered`. Compared
    by identity, so give it the caller's own object (a `TorchFunctionMode` sees it; a dispatch mode is
    handed a new Python object for the same generator).
    """
    generator = kwargs.get("generator")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cuda":
        return None
    known = (*torch.cuda.default_generators, *_REGISTERED.get())
    return None if any(generator is other for other in known) else generator
