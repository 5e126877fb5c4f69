"""`CapturedGraph`: one captured forward, whatever the backend, and the rules every graph keeps.

Replay returns the static output (valid until any graph of the same pool replays; see
`graphcap.backends.pool`), `check_addresses` refuses moved static inputs, `release` drops
the graph. Backends subclass it with their own fields and `_replay` / `_release`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from graphcap.backends.pool import GraphPool
from graphcap.errors import CaptureError, StaticInputMovedError

__all__ = ["CapturedGraph", "is_sticky_cuda_error", "record_input_ptrs", "storage_ptr"]

_MOVED_FIX = (
    "a persistent buffer was replaced by a new tensor after capture; "
    "write into it in place with copy_() or capture again"
)
# CUDA errors that poison the context: every later kernel (eager ones too) fails with them.
_STICKY_CUDA_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "hardware stack error",
    "invalid program counter",
    "operation not supported on global/shared address space",
    "the launch timed out and was terminated",
    "uncorrectable ECC error",
)


# What cuBLAS reports when a kernel failed: its own fault, or the first report of a sticky CUDA error
# ("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm(...)`").
_CUBLAS_KERNEL_FAILED = ("CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_INTERNAL_ERROR")


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA error that leaves the process's CUDA context unusable.

    A device-side assert or an illegal address is sticky: every later CUDA call fails with
    it, and, kernels being asynchronous, it surfaces at some later sync, not at its cause,
    possibly first in cuBLAS, which names only its own status (`CUBLAS_STATUS_EXECUTION_FAILED`).
    For those CUDA itself is asked: a device sync raises the sticky error if there is one.
    """
    text = str(exc)
    if "CUDA error" not in text:
        return False
    if any(marker in text for marker in _STICKY_CUDA_ERRORS):
        return True
    return any(status in text for status in _CUBLAS_KERNEL_FAILED) and _context_poisoned()


def _context_poisoned() -> bool:
    """Whether a device sync raises a sticky CUDA error (the context is unusable)."""
    if not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        return any(marker in str(exc) for marker in _STICKY_CUDA_ERRORS)
    return False


def record_input_ptrs(static_inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """`data_ptr` of every static input by name; `TypeError` naming a bad entry."""
    if not isinstance(static_inputs, Mapping):
        kind = type(static_inputs).__name__
        raise TypeError(f"static_inputs must be a mapping of name -> tensor; got {kind}")
    ptrs = {}
    for name, tensor in static_inputs.items():
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise TypeError(f"static input {name!r} must be a torch.Tensor; got {kind}")
        ptrs[name] = storage_ptr(tensor, name)
    return ptrs


def storage_ptr(tensor: torch.Tensor, name: str) -> int:
    """`tensor.data_ptr()`, or a `CaptureError` naming `name` when the tensor has no storage of its own.

    Tensor subclasses that wrap others (FP8 or torchao quantized weights, DTensor) have no
    storage: a graph reads their inner tensors, and those are what must be address-checked.
    """
    try:
        ptr = tensor.data_ptr()
        if ptr == 0 and tensor.numel() > 0 and tensor.device.type != "meta":
            raise RuntimeError("data_ptr() is 0: no storage is allocated for it")
        return ptr
    except (RuntimeError, NotImplementedError) as exc:
        raise CaptureError(
            f"static input {name!r} is a {type(tensor).__name__} without storage of its own ({exc}); a graph "
            "reads the plain tensors inside it (the quantized data and scales of an FP8 or torchao weight, "
            "a DTensor's local shard): register those instead (CaptureManager.register_static(name, tensor), "
            "or pass them as static inputs), and keep the wrapper out of the static inputs"
        ) from exc


@dataclass(eq=False, repr=False, kw_only=True)
class CapturedGraph:
    """One captured forward: replay it, check its inputs' addresses, release it.

    Contract: `replay()` returns `output`, the static output the graph writes in place.
    It is valid until any graph of the same pool (`graph_pool`: one per backend unless
    shared) replays, this one's next replay included, or the graph is released: clone it
    to keep it. Static inputs must stay where they were at capture (same `data_ptr`);
    write new values into them in place. After `release()`, `output` is None and
    `replay()` raises `CaptureError`.
    """

    name: str
    """The name given at capture (the manager uses the graph key)."""
    output: Any
    """The static output: a tensor, or the tuple, list or dict of tensors the forward returned
    (see the class docstring for how long it is valid); None after `release()`."""
    input_ptrs: dict[str, int]
    """`data_ptr` of every static input at capture, by name."""
    memory_bytes: int
    """Memory the capture took (see the backend)."""
    graph_pool: GraphPool | None = field(default=None, repr=False)
    """The pool whose replays invalidate this graph's output."""
    uncompiled: tuple[str, ...] = ()
    """torch.compile'd functions that ran uncompiled during capture (the replay runs them so)."""
    reads: tuple[torch.Tensor, ...] | None = field(default=None, init=False, repr=False)
    """Every tensor that existed before capture that the captured ops read or write, still alive after it (the
    recording's or the preflight's `ExternalReads`); None where nothing collected them. The manager's guard takes
    them (and sets this to None) once the capture is accepted."""
    num_replays: int = field(default=0, init=False)
    _is_released: bool = field(default=False, init=False)
    _held: tuple[Any, ...] = field(default=(), init=False, repr=False)  # (pool handle,) once counted live

    def hold(self) -> None:
        """Count this graph as live in its pool's current handle (the backend does, once, at capture)."""
        if self.graph_pool is not None and not self._held:
            self._held = (self.graph_pool.hold(),)

    @property
    def is_released(self) -> bool:
        return self._is_released

    def replay(self) -> Any:
        """Run the captured work again; returns `self.output`, overwritten in place."""
        if self._is_released:
            raise CaptureError(f"graph {self.name} was released; capture it again to replay it")
        pool = self.graph_pool
        if pool is None:
            self._replay()
        else:
            with pool.lock:
                pool.before_replay(self)
                self._replay()
        self.num_replays += 1
        return self.output

    def check_addresses(self, static_inputs: Mapping[str, torch.Tensor]) -> None:
        """Raise `StaticInputMovedError` unless `static_inputs` match those recorded at capture.

        Same names, same `data_ptr` each. The graph reads the addresses it saw at capture,
        so a moved input means silently stale output.
        """
        recorded = self.input_ptrs
        for input_name, recorded_ptr in recorded.items():
            tensor = static_inputs.get(input_name)
            if tensor is None:
                raise StaticInputMovedError(
                    f"static input {input_name!r} of graph {self.name} is missing now "
                    f"(recorded at capture: data_ptr {recorded_ptr:#x}; given: "
                    f"{sorted(static_inputs)}); pass the same persistent buffers, "
                    "or capture again",
                    input_name,
                    recorded_ptr,
                    None,
                )
            current_ptr = tensor.data_ptr()
            if current_ptr != recorded_ptr:
                raise StaticInputMovedError(
                    f"static input {input_name!r} of graph {self.name} moved: data_ptr "
                    f"{recorded_ptr:#x} at capture, {current_ptr:#x} now; {_MOVED_FIX}",
                    input_name,
                    recorded_ptr,
                    current_ptr,
                )
        if len(static_inputs) != len(recorded):
            for input_name, tensor in static_inputs.items():
                if input_name not in recorded:
                    raise StaticInputMovedError(
                        f"static input {input_name!r} (data_ptr {tensor.data_ptr():#x}) was "
                        f"not given at capture of graph {self.name} (recorded: "
                        f"{sorted(recorded)}); the graph cannot read it; capture again",
                        input_name,
                        None,
                        tensor.data_ptr(),
                    )

    def release(self) -> None:
        """Drop the graph and what it holds (output included). Idempotent."""
        if self._is_released:
            return
        self._is_released = True
        try:
            self._release()
        finally:
            self.output = None
            pool = self.graph_pool
            if self._held and pool is not None:  # held only from a pool
                (handle,), self._held = self._held, ()
                pool.drop(handle)

    def _replay(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def invalidate_output(self) -> None:
        """Another graph of the pool replays: make the output read as reused memory would."""

    def __repr__(self) -> str:
        state = "released" if self._is_released else f"{self.num_replays} replays"
        return f"{type(self).__name__}({self.name}, {self.memory_bytes} bytes, {state})"
