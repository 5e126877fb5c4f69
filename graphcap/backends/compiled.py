"""`torch.compile` and graph capture: run a forward uncompiled on purpose, and say so.

Dynamo does not compile a frame while a (non-infra) `TorchDispatchMode` is active, and
worse, on torch 2.13 a compiled function first called under such a mode is marked "skip"
for good: later plain calls never compile it, and one compiled with `fullgraph=True`
raises "found no compiled frames" from then on. The unsafe-op checker and the emulated
backend's recorder are such modes. So every forward graphcap runs under a mode runs under
`eager_only()`: `torch.compiler.set_stance("force_eager")`, which leaves dynamo's caches
untouched, plus a note of every compiled function the forward entered, so a backend can
warn that it captured the uncompiled path (the emulated backend always does: its tape
cannot hold compiled kernels that bypass the dispatcher).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch

__all__ = ["eager_only", "uncompiled_warning"]

_EVAL_FRAME = "torch._dynamo.eval_frame"
_WRAPPER = "compile_wrapper"  # the function torch.compile returns (torch/_dynamo/eval_frame.py)
_MODULE_CALLS = ("__call__", "_call_impl", "_wrapped_call_impl")
_stance_lock = threading.RLock()  # the stance is global: one eager_only() at a time, nestable
_ProfileEvent = Literal["call", "return", "c_call", "c_return", "c_exception"]  # what sys.setprofile hooks see


@contextlib.contextmanager
def eager_only() -> Iterator[list[str]]:
    """Run the enclosed code with torch.compile off; yields the compiled functions it entered.

    The list is filled as the code runs ("name (file:line)", once each). Nothing is done
    when dynamo was never imported: then no compiled function exists. The stance is
    process-wide (torch offers no thread-local one): another thread's compiled calls run
    eagerly while this is active.
    """
    entered: list[str] = []
    eval_frame = sys.modules.get(_EVAL_FRAME)
    set_stance = getattr(torch.compiler, "set_stance", None)
    wrapper_file = None if eval_frame is None else eval_frame.__file__
    if wrapper_file is None or set_stance is None:
        yield entered
        return
    with _stance_lock, set_stance("force_eager"), _watch(wrapper_file, entered):
        yield entered


@contextlib.contextmanager
def _watch(wrapper_file: str, entered: list[str]) -> Iterator[None]:
    """Note every call of dynamo's compile wrapper in this thread, beside any profiler or tracer.

    The watch is a profile hook that chains a Python profile function already set (every event
    still reaches it). A C-level profiler (`cProfile`, `torch.profiler` with stacks) is an object
    Python cannot call: it stays in place and the watch uses the trace slot instead, as a global
    trace function that chains a debugger's or coverage's (whose local tracers it returns). With
    both slots held by C-level hooks nothing is noted (a report then misses the warning).
    """
    seen: set[int] = set()

    def note(frame: Any) -> None:
        code = frame.f_code
        if code.co_name == _WRAPPER and code.co_filename == wrapper_file:
            fn = frame.f_locals.get("fn")
            if id(fn) not in seen:
                seen.add(id(fn))
                entered.append(_describe(fn))

    profiler, tracer = sys.getprofile(), sys.gettrace()
    if profiler is None or callable(profiler):

        def hook(frame: Any, event: _ProfileEvent, arg: Any) -> None:
            if event == "call":
                note(frame)
            if profiler is not None:
                profiler(frame, event, arg)

        slot, previous = sys.setprofile, profiler
    elif tracer is None or callable(tracer):

        def hook(frame: Any, event: str, arg: Any) -> Any:  # the global trace function: "call" events
            note(frame)
            return None if tracer is None else tracer(frame, event, arg)

        slot, previous = sys.settrace, tracer
    else:
        yield
        return
    slot(hook)
    try:
        yield
    finally:
        slot(previous)


def _describe(fn: Any) -> str:
    """'Name (file:line)' of the function torch.compile wrapped (a module: its class)."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") in _MODULE_CALLS:
        fn = owner  # torch.compile(module) wraps the module's __call__
    if isinstance(fn, torch.nn.Module):
        fn, name = type(fn).forward, f"{type(fn).__name__}.forward"
    else:
        name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def uncompiled_warning(backend: str, name: str, functions: list[str] | tuple[str, ...]) -> str:
    """The message a backend gives when it captured torch.compile'd code uncompiled."""
    shown = "; ".join(functions[:3]) + (f"; and {len(functions) - 3} more" if len(functions) > 3 else "")
    return (
        f"the {backend} backend captured {name} without torch.compile: {shown} ran uncompiled during capture, "
        "so replays run the eager kernels while eager steps run the compiled ones (results may differ "
        "within tolerance, speed does). The emulated backend records aten ops and cannot hold compiled "
        "kernels; on the cuda backend this happens only with check_input_liveness"
    )
