"""CPU emulation of CUDA graphs: record the forward's aten op tape once, replay the tape.

Faithful to what a CUDA graph does, so CPU tests mean something (docs/EMULATION.md lists
what it reproduces and what it cannot, each with its test):

- Capture runs the forward once under a `TorchDispatchMode` that checks every op against
  `graphcap.backends.unsafe` and records it (with torch.compile off: the tape holds aten
  ops, so compiled code is captured uncompiled, with a warning). Tensors an op receives
  that no earlier op on the tape produced (weights, persistent buffers, the KV cache) are
  externals, held by the storage they had at capture, as a CUDA graph holds their
  address: a `param.data = ...` swap afterwards is not seen by replays, which read the
  old (stale) data; tensors made during capture are tape slots; everything else is a
  constant.
- Replay re-executes the tape (the recorded aten overloads, under `inference_mode`; see
  `graphcap.backends.tape`), never the Python forward: control flow, shapes and Python
  scalars are frozen at capture, in-place writes to externals happen again, and the
  result is copied into the output tensor returned at capture, which every replay
  overwrites.
- Graphs of one pool share memory on CUDA, so another graph's replay may overwrite an
  output: here, replaying a graph fills the last other graph's output with NaN (integers:
  their minimum), so code that keeps an output past the next step fails on the CPU too.
- Slots are freed after their last use and nothing but externals and the output lives
  between replays; the same liveness gives `memory_bytes`.

- While it records (and only then), `torch.cuda.is_current_stream_capturing()` answers True,
  as CUDA's does inside a capture: code that asks it (vLLM's and SGLang's custom all-reduce)
  records its real collective; warmups, verification and eager steps get False (torch's own
  answer, or False where a CPU-only build of torch raises for want of a CUDA runtime), while any
  emulated backend lives; then torch's own function is put back (`graphcap.backends.stream_answer`).

Not emulated: static addresses of intermediates (a replay allocates fresh ones), and the
device-side behaviour of captured kernels (capture here runs them, so the output holds
fn's result right after capture, and in-place writes happen once during capture).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from graphcap.backends.base import Forward, GraphBackend
from graphcap.backends.compiled import eager_only
from graphcap.backends.generators import registered
from graphcap.backends.graph import CapturedGraph
from graphcap.backends.pieces import EmulatedPieceSession
from graphcap.backends.pool import invalidate
from graphcap.backends.preflight import unsafe_op_checker
from graphcap.backends.reads import ExternalReads
from graphcap.backends.stream_answer import StreamAnswer, stream_capturing
from graphcap.backends.tape import Tape, TapeRecorder, compile_tape
from graphcap.outputs import flatten_output
from graphcap.torch_modes import no_torch_function

__all__ = ["EmulatedBackend", "EmulatedGraph", "stream_capturing"]


@dataclass(eq=False, repr=False, kw_only=True)
class EmulatedGraph(CapturedGraph):
    """A recorded tape standing in for a CUDA graph; see the module docstring."""

    tape: Tape | None = field(default=None, repr=False)
    leaves: list[torch.Tensor] = field(default_factory=list, repr=False)
    """The output's tensors (one, or those of a tuple, list or dict), as `tape.result_slots`."""

    def _replay(self) -> None:
        # The outputs are inference tensors: copy_ needs inference mode. A CUDA graph's replay runs no Python, so
        # no torch function mode of the engine sees its ops: neither does the tape's.
        with torch.inference_mode(), no_torch_function():
            tape = self.tape
            assert tape is not None  # set by the capture; replay() refuses a released graph first
            for leaf, value in zip(self.leaves, tape.run()):
                if value is not None:
                    leaf.copy_(value)

    def _release(self) -> None:
        self.tape = None
        self.leaves = []

    def invalidate_output(self) -> None:
        # An output that views an external (the forward returned a slice of a buffer it
        # writes) lives outside the pool on CUDA too: nothing reuses it.
        if self.tape is not None:
            for leaf, slot in zip(self.leaves, self.tape.result_slots):
                if slot >= 0:
                    invalidate(leaf)


class EmulatedBackend(GraphBackend):
    """CUDA-graph semantics on the CPU (or any device), for tests and machines without a GPU.

    `memory_in_use()` is the sum of the live graphs' `memory_bytes`; `free_memory()` is None.
    """

    name = "emulated"
    checks_in_capture = True  # the recording is the preflight's checked run: see `_capture`

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # torch.cuda.is_current_stream_capturing() answers (False; True while recording) as long as this lives.
        answer = StreamAnswer()
        answer.hold()
        weakref.finalize(self, answer.release)

    def _capture(self, fn: Forward, *, name: str, input_ptrs: dict[str, int]) -> EmulatedGraph:
        reads = ExternalReads()
        recorder = TapeRecorder(self.device, reads)
        try:
            # Every check of the preflight (graphcap.backends.preflight.preflight, which runs sync-debug only on
            # CUDA backends), raising the same errors: a capture pass need not run a checked warmup before it.
            with (
                eager_only() as uncompiled,
                registered(self.generators),
                unsafe_op_checker(self.device, recorder),
                stream_capturing(),
            ):
                output = fn()
            leaves, _ = flatten_output(output, name)
            tape = compile_tape(recorder.records, leaves)
        finally:
            recorder.records.clear()  # capture-time intermediates die here, also on failure
        # The outputs persist between replays next to the tape's transient peak.
        storages = {leaf.untyped_storage().data_ptr(): leaf.untyped_storage().nbytes()
                    for leaf, slot in zip(leaves, tape.result_slots) if slot >= 0}  # fmt: skip
        graph = EmulatedGraph(
            name=name,
            output=output,
            leaves=leaves,
            input_ptrs=input_ptrs,
            memory_bytes=tape.peak_bytes + sum(storages.values()),
            graph_pool=self.pool,
            uncompiled=tuple(uncompiled),
            tape=tape,
        )
        graph.reads = tuple(reads.tensors())  # the externals still alive: the records are gone
        return graph

    def memory_in_use(self) -> int:
        return sum(graph.memory_bytes for graph in self.graphs)

    def _piece_session(self, name: str) -> EmulatedPieceSession:
        return EmulatedPieceSession(self, name)
