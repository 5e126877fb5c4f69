"""`ExternalReads`: what a checked run read that it did not make, found from the ops it dispatched.

A CUDA graph reads, at the addresses they had at capture, every tensor that existed before capture and that
its ops receive: weights, buffers, staged inputs, and caches an engine keeps wherever it likes (nano-vllm's
`Attention.k_cache`, a plain attribute; vLLM's list of layer caches). Declaring them (`register_static`,
module buffers) misses what the engine keeps elsewhere; the ops say it exactly. The emulated backend's
recording (`TapeRecorder`) and every backend's preflight (`graphcap.backends.preflight.preflight`) collect them
here: a tensor an op receives that no earlier op of the run returned is *read*; one an op returns is *made*.
Both by weak reference, so nothing here keeps a tensor alive: after the run, `tensors()` is what is still alive,
which leaves out constants a forward builds outside the ops (`torch.tensor([...])`) and drops again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ExternalReads"]


class ExternalReads:
    """The tensors a run's ops received without making them (`before`, `after` around each op), by identity."""

    __slots__ = ("_made", "_read")

    def __init__(self) -> None:
        self._made: dict[int, weakref.ref] = {}
        self._read: dict[int, weakref.ref] = {}

    def before(self, args: tuple, kwargs: dict) -> None:
        """An op receives `args` and `kwargs`: every tensor among them no earlier op made is read."""
        made, read = self._made, self._read
        for tensor in _leaves(args, kwargs):
            identity = id(tensor)
            ref = made.get(identity)
            if ref is not None and ref() is tensor:
                continue
            ref = read.get(identity)
            if ref is None or ref() is not tensor:
                read[identity] = weakref.ref(tensor)

    def after(self, out: Any) -> None:
        """An op returned `out`: its tensors are made, except the inputs an in-place op hands back."""
        made, read = self._made, self._read
        for tensor in _leaves((out,), {}):
            identity = id(tensor)
            ref = read.get(identity)
            if ref is None or ref() is not tensor:
                made[identity] = weakref.ref(tensor)

    def tensors(self) -> list[torch.Tensor]:
        """The read tensors still alive, in the order the run first read them."""
        alive = (ref() for ref in self._read.values())
        return [tensor for tensor in alive if tensor is not None]


def _leaves(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
