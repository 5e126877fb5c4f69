"""CPU emulation of CUDA graphs: record the forward's aten op tape once, replay the tape.

Faithful to what a CUDA graph does, so CPU tests mean something:

- Capture runs the forward once under a `TorchDispatchMode` that checks every op against
  `graphcap.backends.unsafe` and records it. Tensors an op receives that no earlier op on
  the tape produced (weights, persistent buffers, the KV cache) are externals, held by
  identity; tensors made during capture are tape slots; everything else is a constant.
- Replay re-executes the tape (the recorded aten overloads, under `inference_mode`; see
  `graphcap.backends.tape`), never the Python forward: control flow, shapes and Python
  scalars are frozen at capture, in-place writes to externals happen again, and the
  result is copied into the output tensor returned at capture, which every replay
  overwrites.
- Slots are freed after their last use and nothing but externals and the output lives
  between replays; the same liveness gives `memory_bytes`.

Not emulated: static addresses of intermediates (a replay allocates fresh ones), and the
device-side behaviour of captured kernels (capture here runs them, so the output holds
fn's result right after capture, and in-place writes happen once during capture).
"""

from __future__ import annotations

import torch

from graphcap.backends.base import CapturedGraph, Forward, GraphBackend, check_output
from graphcap.backends.tape import Tape, TapeRecorder, compile_tape
from graphcap.backends.unsafe import unsafe_op_checker

__all__ = ["EmulatedBackend", "EmulatedGraph"]


class EmulatedGraph(CapturedGraph):
    """A recorded tape standing in for a CUDA graph; see the module docstring."""

    def __init__(
        self,
        *,
        name: str,
        output: torch.Tensor,
        input_ptrs: dict[str, int],
        tape: Tape,
    ) -> None:
        output_bytes = 0 if tape.result_slot < 0 else output.untyped_storage().nbytes()
        # The output persists between replays next to the tape's transient peak.
        super().__init__(
            name=name,
            output=output,
            input_ptrs=input_ptrs,
            memory_bytes=tape.peak_bytes + output_bytes,
        )
        self._tape: Tape | None = tape

    def _replay(self) -> None:
        with torch.inference_mode():  # the output is an inference tensor: copy_ needs it
            value = self._tape.run()
            if value is not None:
                self.output.copy_(value)

    def _release(self) -> None:
        self._tape = None


class EmulatedBackend(GraphBackend):
    """CUDA-graph semantics on the CPU (or any device), for tests and machines without a GPU.

    `memory_in_use()` is the sum of the live graphs' `memory_bytes`; `free_memory()` is None.
    """

    name = "emulated"

    def _capture(self, fn: Forward, *, name: str, input_ptrs: dict[str, int]) -> EmulatedGraph:
        recorder = TapeRecorder(self.device)
        try:
            with unsafe_op_checker(self.device, recorder):
                output = fn()
            tape = compile_tape(recorder.records, check_output(output, name))
        finally:
            recorder.records.clear()  # capture-time intermediates die here, also on failure
        return EmulatedGraph(name=name, output=output, input_ptrs=input_ptrs, tape=tape)

    def memory_in_use(self) -> int:
        return sum(graph.memory_bytes for graph in self.graphs)
