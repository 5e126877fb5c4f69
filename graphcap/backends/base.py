"""The backend protocol and the orchestration every backend shares.

A backend captures a zero-argument forward closure into a `CapturedGraph` and replays it.
This module owns everything that does not need a GPU, so the CPU tests exercise it
through the emulated backend: the errors, the address check, the registry of live
graphs, the warmup loop (the first warmup runs under the unsafe-op checker), argument
validation and the rules on call order (captures do not nest; nothing is warmed up,
captured or reset while a capture is under way).

Subclasses implement `_capture` (which must leave nothing behind when it raises),
`_replay`/`_release` on their graph class, and the memory queries. They do not wrap
errors: a `CaptureUnsafeError` and any other exception (`torch.OutOfMemoryError`
included) propagate unchanged; the manager adds the graph key and a hint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

from graphcap.backends.unsafe import unsafe_op_checker
from graphcap.errors import CaptureError, CaptureUnsafeError, StaticInputMovedError

__all__ = [
    "CaptureError",
    "CaptureUnsafeError",
    "CapturedGraph",
    "Forward",
    "GraphBackend",
    "StaticInputMovedError",
]

Forward = Callable[[], torch.Tensor]
"""A forward closure: no arguments, reads its static inputs itself, returns one tensor."""

_MOVED_FIX = (
    "a persistent buffer was replaced by a new tensor after capture; "
    "write into it in place with copy_() or capture again"
)


def _record_input_ptrs(static_inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    if not isinstance(static_inputs, Mapping):
        kind = type(static_inputs).__name__
        raise TypeError(f"static_inputs must be a mapping of name -> tensor; got {kind}")
    ptrs = {}
    for name, tensor in static_inputs.items():
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise TypeError(f"static input {name!r} must be a torch.Tensor; got {kind}")
        ptrs[name] = tensor.data_ptr()
    return ptrs


class CapturedGraph:
    """One captured forward: replay it, check its inputs' addresses, release it.

    Contract: `output` is the tensor the forward returned at capture; every `replay()`
    overwrites it in place and returns it, so a caller that keeps it across replays sees
    the latest values. Static inputs must stay where they were at capture (same
    `data_ptr`); write new values into them in place. After `release()`, `output` is None
    and `replay()` raises `CaptureError`.
    """

    name: str
    output: torch.Tensor
    input_ptrs: dict[str, int]
    memory_bytes: int
    num_replays: int

    def __init__(
        self,
        *,
        name: str,
        output: torch.Tensor,
        input_ptrs: dict[str, int],
        memory_bytes: int,
    ) -> None:
        self.name = name
        self.output = output
        self.input_ptrs = input_ptrs
        self.memory_bytes = memory_bytes
        self.num_replays = 0
        self._is_released = False

    @property
    def is_released(self) -> bool:
        return self._is_released

    def replay(self) -> torch.Tensor:
        """Run the captured work again; returns `self.output`, overwritten in place."""
        if self._is_released:
            raise CaptureError(f"graph {self.name} was released; capture it again to replay it")
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
        self._release()
        self.output = None  # type: ignore[assignment]  # documented: None after release

    def _replay(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "released" if self._is_released else f"{self.num_replays} replays"
        return f"{type(self).__name__}({self.name}, {self.memory_bytes} bytes, {state})"


class GraphBackend:
    """Captures forward closures into graphs on one device and keeps the live ones.

    Does not decide what to capture, stage inputs, wrap errors with graph keys or manage
    `gc`: that is the manager's job. Call order: `warmup` then `capture` per key; never
    from inside a forward being captured.
    """

    name: str
    device: torch.device

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._graphs: list[CapturedGraph] = []
        self._is_capturing = False

    @property
    def graphs(self) -> tuple[CapturedGraph, ...]:
        """The live (captured, not released) graphs, in capture order."""
        self._graphs = [g for g in self._graphs if not g.is_released]
        return tuple(self._graphs)

    def warmup(self, fn: Forward, num_warmups: int) -> None:
        """Call `fn` eagerly `num_warmups` times, the first under the unsafe-op checker.

        Runs under `torch.inference_mode()`, like capture. The checked first call names an
        op a CUDA graph cannot hold (op, reason, user file:line) as `CaptureUnsafeError`.
        """
        if isinstance(num_warmups, bool) or not isinstance(num_warmups, int) or num_warmups < 0:
            raise ValueError(f"num_warmups must be an int >= 0; got {num_warmups!r}")
        _check_callable(fn)
        self._check_not_capturing("warmup()")
        with self._warmup_context(), torch.inference_mode():
            for index in range(num_warmups):
                if index == 0:
                    with unsafe_op_checker(self.device):
                        fn()
                else:
                    fn()

    def capture(
        self,
        fn: Forward,
        static_inputs: Mapping[str, torch.Tensor],
        *,
        name: str,
    ) -> CapturedGraph:
        """Capture `fn` (no arguments; it reads `static_inputs` itself) into a graph.

        Records each static input's `data_ptr`. Returns the graph, registered with this
        backend; `graph.output` is fn's result at capture. On failure nothing stays
        registered or allocated and the exception propagates unchanged.
        """
        _check_callable(fn)
        input_ptrs = _record_input_ptrs(static_inputs)
        self._check_not_capturing("capture()")
        self._is_capturing = True
        try:
            with torch.inference_mode():
                graph = self._capture(fn, name=name, input_ptrs=input_ptrs)
        finally:
            self._is_capturing = False
        try:
            # fn may have resized or `set_()` a buffer while it ran; the graph would then
            # hold an address the caller no longer uses.
            graph.check_addresses(static_inputs)
        except StaticInputMovedError:
            graph.release()
            raise
        self._graphs.append(graph)
        return graph

    def reset(self) -> None:
        """Release every graph this backend captured, then its memory pool."""
        self._check_not_capturing("reset()")
        for graph in self._graphs:
            graph.release()
        self._graphs = []
        self._reset_pool()

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work."""

    def memory_in_use(self) -> int:
        raise NotImplementedError

    def free_memory(self) -> int | None:
        """Free device memory in bytes, or None where the notion does not apply."""
        return None

    def _capture(self, fn: Forward, *, name: str, input_ptrs: dict[str, int]) -> CapturedGraph:
        raise NotImplementedError

    def _warmup_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _reset_pool(self) -> None:
        """Hook for backends with a memory pool (runs after every graph was released)."""

    def _check_not_capturing(self, what: str) -> None:
        if self._is_capturing:
            raise CaptureError(
                f"{what} called on the {self.name} backend while a capture is under way; "
                "captures do not nest: call it outside the forward being captured"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, {len(self.graphs)} graphs)"


def check_output(output: object, name: str) -> torch.Tensor:
    """Return `output` if it is a tensor, else raise the error that says what fn returned."""
    if not isinstance(output, torch.Tensor):
        raise CaptureError(
            f"the forward captured as {name} returned {type(output).__name__}; it must return "
            "one torch.Tensor (return a tuple's tensors concatenated, or capture each apart)"
        )
    return output


def _check_callable(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments; got {type(fn).__name__}")
