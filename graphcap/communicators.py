"""`Communicator`: an engine's communicator (a custom all-reduce, a symmetric-memory buffer) in a capture pass.

vLLM's and SGLang's custom all-reduce need three things from the code that captures: to know a
capture pass is starting (they switch to graph buffers), to register the buffers each captured
graph uses (IPC handles of the addresses baked into the graph), and the end of the pass (the
registration is a collective over the TP group, done once, before any graph replays). An engine
subclasses `Communicator`, overrides what it needs, and passes instances as
`CaptureManager(..., communicators=[...])`. During a pass graphcap calls, in this order:

- `capture_begin()`: inside `capture_context`, before the first key of the pass;
- `key_captured(key)`: right after each key's graph is captured (not for a failed key), still
  inside the pass, in capture order;
- `capture_end()`: after the last key, inside `capture_context` (also when the pass fails, so a
  communicator never stays in capture mode); verification runs after it returns, so every
  replay of verification reads registered buffers.

A model asks `graphcap.is_capturing()` whether a graph is recording right now (the warmups
before each capture run the same forward without recording). `capture_context` stays the
simple form: a context manager around the captures of a pass. Every rank calls the hooks in
the same order (capture runs in lockstep), so a hook may run collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["Communicator", "communicators_of", "holds_collectives", "key_captured_hook", "pass_context"]


class Communicator:
    """Hooks of one communicator around a capture pass; the defaults do nothing (see the module doc)."""

    def capture_begin(self) -> None:
        """A capture pass starts (inside `capture_context`, before the first key)."""

    def key_captured(self, key: Any) -> None:
        """`key`'s graph was captured: register the buffers it uses."""

    def capture_end(self) -> None:
        """The pass captured its last key (or failed): register the graphs' buffers; verification follows."""


def communicators_of(communicators: Iterable[Communicator]) -> tuple[Communicator, ...]:
    """The communicators as a tuple; `TypeError` naming the first that is not a `Communicator`."""
    if isinstance(communicators, Communicator) or not isinstance(communicators, Iterable):
        raise TypeError(f"communicators must be a list of graphcap.Communicator; got {type(communicators).__name__}")
    found = tuple(communicators)
    for i, item in enumerate(found):
        if not isinstance(item, Communicator):
            raise TypeError(
                f"communicators[{i}] is a {type(item).__name__}; subclass graphcap.Communicator and override "
                "capture_begin / key_captured / capture_end"
            )
    return found


def pass_context(
    context: Callable[[], AbstractContextManager[object]] | None, communicators: tuple[Communicator, ...]
) -> Callable[[], AbstractContextManager[object]]:
    """`context` (None: none), with each communicator's `capture_begin` after entering it and `capture_end` before
    leaving; `TypeError` unless `context` is a callable returning a context manager."""
    if context is not None and not callable(context):
        raise TypeError(
            "capture_context must be a callable returning a context manager (e.g. a "
            f"@contextlib.contextmanager function); got {type(context).__name__}"
        )
    context = context or contextlib.nullcontext
    if not communicators:
        return context

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with context(), contextlib.ExitStack() as ends:
            for communicator in communicators:
                communicator.capture_begin()
                ends.callback(communicator.capture_end)
            yield

    return entered


def key_captured_hook(communicators: tuple[Communicator, ...]) -> Callable[[Any], None] | None:
    """A function calling every communicator's `key_captured(key)`, or None when there are none."""
    if not communicators:
        return None

    def key_captured(key: Any) -> None:
        for communicator in communicators:
            communicator.key_captured(key)

    return key_captured


_COLLECTIVE_NAMESPACES = ("_c10d_functional::", "c10d::", "c10d_functional::")


def holds_collectives(graphs: Iterable[Any], communicators: tuple[Communicator, ...] = ()) -> bool | None:
    """Whether the forward the graphs recorded holds a collective: True when communicators are given or a graph's
    tape records one (the emulated backend records every op); False when every graph is a tape without one;
    None when it cannot tell (no graph yet, or a CUDA graph, whose kernels graphcap does not see)."""
    if communicators:
        return True
    graphs = list(graphs)
    if not graphs:
        return None
    known = True
    for graph in graphs:
        tape = getattr(graph, "tape", None)
        if tape is None:
            known = False
            continue
        for step in tape.steps:
            op = step[0]
            name = str(getattr(op, "_name", None) or getattr(op, "__qualname__", None) or op)
            if name.startswith(_COLLECTIVE_NAMESPACES):
                return True
    return False if known else None
