"""The checker that names an op a CUDA graph cannot hold, before capture turns it into CUDA error 900.

`unsafe_op_checker(device)` runs a forward against `graphcap.backends.unsafe.UNSAFE_OPS`
through three hooks: a `TorchDispatchMode` (aten ops), a `TorchFunctionMode` (Python
methods such as `.item()` and the `torch.tensor`-like uploads that never reach the
dispatcher's Python key) and wrappers around the Python-level GPU waits
(`torch.cuda.synchronize`, stream and event `synchronize`/`query`, `empty_cache`). Each
raises `CaptureUnsafeError` naming the op, the reason and the innermost stack frame
outside torch and outside graphcap/backends, i.e. the user's line.

`preflight(device)` is what a backend's first warmup runs: the checker, torch.compile off
(`graphcap.backends.compiled`: a mode must never be the first thing a compiled function
meets) and, on CUDA, `torch.cuda.set_sync_debug_mode("error")`, whose error for any sync
the table missed becomes a `CaptureUnsafeError` too. `check_capture_safe(fn, device)` is
the same preflight as a public lint.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphcap.backends import generators as _generators
from graphcap.backends.compiled import eager_only
from graphcap.backends.locations import user_location as _user_location
from graphcap.backends.reads import ExternalReads
from graphcap.backends.sync_debug import SYNC_DEBUG_TEXT, sync_debug_errors, sync_debug_off, sync_error
from graphcap.backends.unsafe import PYTHON_UPLOADS, SYNC_FUNCTIONS, UNSAFE_OPS, UnsafeOp, python_upload_row
from graphcap.errors import CaptureUnsafeError
from graphcap.phases import mark_failure

__all__ = [
    "UnsafeOpMode",
    "check_capture_safe",
    "check_op",
    "in_preflight",
    "outside_checks",
    "preflight",
    "sync_debug_errors",
    "unsafe_op_checker",
]
# `sync_debug_errors` lives in graphcap.backends.sync_debug; imported from here by earlier code.

# Python methods and functions, looked up by the object torch hands to __torch_function__.
_FUNCTIONS: dict[Any, UnsafeOp] = {}
for _name, _row in UNSAFE_OPS.items():
    if _name.startswith("Tensor."):
        _FUNCTIONS[getattr(torch.Tensor, _name.removeprefix("Tensor."))] = _row
    elif _name in ("torch.tensor", "torch.as_tensor", "torch.asarray"):
        _FUNCTIONS[getattr(torch, _name.removeprefix("torch."))] = _row


def _raise(row: UnsafeOp, shown_name: str) -> None:
    raise CaptureUnsafeError(shown_name, _user_location(), row.reason, row.fix)


def _row_for(func: Any) -> UnsafeOp | None:
    known = _ROWS.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    row = UNSAFE_OPS.get(str(func._overloadpacket))
    _ROWS[id(func)] = (func, row)
    return row


_ROWS: dict[int, tuple[Any, UnsafeOp | None]] = {}
"""The table's row per aten overload, keyed by `id` (every op of a checked forward asks, and an `OpOverload`
hashes in Python); the overload is kept and compared by identity, so a reused id never answers for another."""


def _on_device(value: Any, device_type: str) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == device_type
    return isinstance(value, torch.device) and value.type == device_type


def _touches_device(args: tuple, kwargs: dict, device_type: str) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            if any(_on_device(v, device_type) for v in value):
                return True
        elif _on_device(value, device_type):
            return True
    return False


def check_op(func: Any, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Raise `CaptureUnsafeError` if the aten overload `func` is unsafe on `device`."""
    row = _row_for(func)
    if row is None or not _touches_device(args, kwargs, device.type):
        return
    if row.applies is None or row.applies(func, args, kwargs, device):
        overload = func._overloadname
        _raise(row, row.name if overload == "default" else f"{row.name}.{overload}")


class _HostReadMode(TorchFunctionMode):
    """Catches host reads, host copies and uploads by Python function (invisible as aten ops), and random
    draws from a CUDA generator capture would not know (only here is the caller's generator object seen:
    the dispatcher hands modes a new Python object for it)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._device.type == "cuda" and _generators.unregistered_generator(kwargs) is not None:
            raise CaptureUnsafeError(_python_name(func), _user_location(), _generators.REASON, _generators.FIX)
        if func in PYTHON_UPLOADS and self._device.type != "cpu":
            row = python_upload_row(func, args, kwargs, self._device)
            if row is not None:
                _raise(row, row.name)
        row = _FUNCTIONS.get(func)
        if row is not None and (row.applies is None or row.applies(func, args, kwargs, self._device)):
            is_method = row.name.startswith("Tensor.")
            if not is_method or (args and isinstance(args[0], torch.Tensor) and _on_device(args[0], self._device.type)):
                _raise(row, row.name)
        return func(*args, **kwargs)


def _python_name(func: Any) -> str:
    """`Tensor.normal_` for a tensor method, `torch.randn` for a torch function."""
    name = getattr(func, "__name__", str(func))
    is_method = getattr(func, "__qualname__", "").split(".")[0] in ("Tensor", "TensorBase")
    return f"Tensor.{name}" if is_method else f"torch.{name}"


class UnsafeOpMode(TorchDispatchMode):
    """Checks every aten op against the table, then runs it via `run_op` (a recorder hook).

    A sync that `set_sync_debug_mode("error")` reports while an op runs names that op. `reads`: collects
    the tensors the ops read that they did not make (`ExternalReads`).
    """

    def __init__(self, device: torch.device | str, reads: ExternalReads | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.reads = reads

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling wrapper (importing dynamo on the first
        # op, seconds, and a few microseconds on every op after); the checks run with torch.compile off
        # (`eager_only`), so nothing is ever compiled inside this mode.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_op(func, args, kwargs, self.device)
        reads = self.reads
        try:
            if reads is None:
                return self.run_op(func, args, kwargs)
            reads.before(args, kwargs)
            out = self.run_op(func, args, kwargs)
            reads.after(out)
            return out
        except RuntimeError as exc:
            if SYNC_DEBUG_TEXT not in str(exc) or isinstance(exc, CaptureUnsafeError):
                raise
            raise sync_error(str(func), _user_location()) from exc

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # Under inference mode a composite op (aten.to, narrow.Tensor) reaches the mode whole;
        # the kernel below would then run its parts unchecked (FakeTensorMode decomposes it
        # out of sight): decompose it here, with the checker on, so every part is checked.
        decompose = _composite_kernel(func)
        if decompose is not None:
            # The mode back on torch's stack for the parts: `with self` would also set the flags its outer
            # entry already set (this handler runs inside it), at several times the cost, on every composite op.
            torch._C._push_on_torch_dispatch_stack(self)
            try:
                result = decompose(*args, **kwargs)
            finally:
                torch._C._pop_torch_dispatch_stack(None)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def _composite_kernel(func: Any) -> Callable | None:
    """`_composite_parts(func)`, looked up once per overload (by identity, as `_row_for`)."""
    known = _KERNELS.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    kernel = _composite_parts(func)
    _KERNELS[id(func)] = (func, kernel)
    return kernel


_KERNELS: dict[int, tuple[Any, Callable | None]] = {}


def _composite_parts(func: Any) -> Callable | None:
    """What runs an aten composite op as its parts (each reaching the mode again), or None for an op with no parts.

    The C++ composite kernel where torch has one (what eager runs, and far cheaper than the Python
    decomposition torch registers for tracing: matmul's costs about a millisecond a call), else
    `OpOverload.decompose`. Looked up once per overload: most ops have no composite kernel, and then
    the mode is not entered again at all.
    """
    if func.namespace != "aten":
        return None
    native = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
    op_dk = getattr(func, "_op_dk", None)  # private: feature-detected
    if native and op_dk is not None:
        return functools.partial(op_dk, _COMPOSITE)
    if native or _COMPOSITE in getattr(func, "py_kernels", {}):
        return func.decompose
    return None


class _SyncGuard:
    """Wraps the Python-level GPU waits while any checker runs; only checked threads are refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._local = threading.local()
        self._originals: list[tuple[Any, str, Callable | None]] = []

    def is_active(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for owner, attribute, original in reversed(self._originals):
                        if original is None:
                            delattr(owner, attribute)  # it was inherited: drop the wrapper
                        else:
                            setattr(owner, attribute, original)
                    self._originals.clear()

    def _install(self) -> None:
        for name in SYNC_FUNCTIONS:
            *path, attribute = name.split(".")[1:]  # drop "torch"
            owner: Any = torch
            for part in path:
                owner = getattr(owner, part)
            own = vars(owner).get(attribute)  # None when a class inherits it
            self._originals.append((owner, attribute, own))
            setattr(owner, attribute, self._refusing(UNSAFE_OPS[name], getattr(owner, attribute)))

    def _refusing(self, row: UnsafeOp, original: Callable) -> Callable:
        @functools.wraps(original)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            if self.is_active():
                _raise(row, row.name)
            return original(*args, **kwargs)

        return refuse


_sync_guard = _SyncGuard()


@contextlib.contextmanager
def unsafe_op_checker(device: torch.device | str, mode: UnsafeOpMode | None = None) -> Iterator[None]:
    """Run the enclosed forward under the checker; `mode` may be a recording subclass.

    Callers that may run torch.compile'd code enter `eager_only()` first (see `preflight`).
    """
    device = torch.device(device)
    with _sync_guard(), _HostReadMode(device), mode if mode is not None else UnsafeOpMode(device):
        yield


@contextlib.contextmanager
def preflight(
    device: torch.device | str,
    *,
    sync_debug: bool = False,
    generators: Iterable[torch.Generator] = (),
    reads: ExternalReads | None = None,
) -> Iterator[list[str]]:
    """The checked first warmup: torch.compile off, the checker on, and (CUDA) sync-debug errors.

    `sync_debug` turns CUDA's process-wide sync-debug mode on (`graphcap.backends.sync_debug`).
    `generators`: the generators registered with the graphs at capture (an op drawing from any other
    non-default CUDA generator is named). Yields the compiled functions the forward entered (they
    ran uncompiled, by design). `reads`: collects every tensor the forward's ops read without making it
    (`ExternalReads`: what a graph captured next reads in place).
    """
    _preflights.depth = getattr(_preflights, "depth", 0) + 1
    try:
        with (
            eager_only() as uncompiled,
            _generators.registered(generators),
            unsafe_op_checker(device, None if reads is None else UnsafeOpMode(device, reads)),
            sync_debug_errors(sync_debug),
        ):
            yield uncompiled
    except BaseException as exc:
        mark_failure(exc, "preflight")  # what a post-mortem names as the failing phase
        raise
    finally:
        _preflights.depth -= 1


_preflights = threading.local()


def in_preflight() -> bool:
    """Whether this thread runs inside `preflight()` (torch.compile off, the checker on)."""
    return getattr(_preflights, "depth", 0) > 0


def check_capture_safe(
    fn: Callable[[], Any], device: torch.device | str, *, generators: Iterable[torch.Generator] = ()
) -> Any:
    """Run `fn()` once under the preflight; return its result, or raise `CaptureUnsafeError`.

    The error names the first op a CUDA graph cannot hold on `device`, why, what to write
    instead, and the line of your code that called it (`.op`, `.location`, `.reason`,
    `.fix`). Engines lint their forward with it. `fn` runs eagerly under
    `torch.inference_mode()` with torch.compile off (the uncompiled Python is what is
    checked). A random op drawing from a CUDA generator other than the device's default and
    those in `generators` (the ones you give the manager) is named too. On a real CUDA device,
    syncs the table does not know are caught by `torch.cuda.set_sync_debug_mode("error")`,
    which is process-wide: while `fn` runs, a sync in any other thread of the process raises
    too. Works on tensors of a CUDA device under
    `torch._subclasses.fake_tensor.FakeTensorMode`, so it runs on machines without a GPU::

        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(8, 64, device="cuda")
            check_capture_safe(lambda: model_step(x), "cuda")
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments; got {type(fn).__name__}")
    device = torch.device(device)
    registered = _generators.check_generators(generators, device, "check_capture_safe(generators=...)")
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    with torch.inference_mode(), preflight(device, sync_debug=on_gpu, generators=registered):
        return fn()


@contextlib.contextmanager
def outside_checks() -> Iterator[None]:
    """Run the enclosed code with every Python mode popped and this thread's sync guard off.

    What an `eager_op`'s body runs under while its forward is checked or recorded: the body is
    allowed what a graph cannot hold (it runs eagerly between graph pieces), host syncs included,
    so CUDA's process-wide `set_sync_debug_mode` is off inside (the preflight turns it on). The
    modes, and the sync-debug mode, are restored on every exit path.
    """
    local = _sync_guard._local
    depth = getattr(local, "depth", 0)
    local.depth = 0
    functions = []
    while torch._C._len_torch_function_stack() > 0:
        functions.append(torch._C._pop_torch_function_stack())
    try:
        with torch.utils._python_dispatch._disable_current_modes(), sync_debug_off():
            yield
    finally:
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)
        local.depth = depth
