"""`Recorder`: record one key's graph: its dummy batch staged as real steps are, warmups, the backend's capture.

`record(key)` returns the key's `Recorded` (its outcome and graph); a failure is settled by the failure policy
(raised, or the key recorded as skipped with no graph), naming the run it failed in and the batch's counts.
The recorder also makes the batches and runs verification replays against (`capture_batch`, `sampled`,
`reference_run`): the verifier runs the graph's code path on them as the recording did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphcap.backends import CapturedGraph
from graphcap.backends.pieces import forbidden_reads
from graphcap.backends.preflight import outside_checks
from graphcap.batch import StepBatch, dummy_batch
from graphcap.capture.failures import failing_in
from graphcap.capture.outcome import KeyOutcome, Recorded
from graphcap.capture.parts import CaptureParts
from graphcap.capture.verification import LastRun
from graphcap.checks.recorded import watch_recording
from graphcap.errors import CaptureError
from graphcap.inputs import ForwardInputs
from graphcap.keys import GraphKey, KeyRegistry, Mode
from graphcap.outputs import StepOutput, cloned
from graphcap.piecewise import Phase, running
from graphcap.staging.extras import sampled

__all__ = ["Recorder", "WarmupSession", "capture_reqs", "dummy_counts"]

Run = Callable[[], StepOutput]


class Recorder:
    """Records keys with `parts` (the manager's staging path, forward, backend, outputs and failure policy)."""

    def __init__(self, parts: CaptureParts) -> None:
        self.parts = parts
        self.forward = parts.capture_forward()
        """The forward the pass runs (inside the ledger's segments where there is one)."""

    def record(self, key: GraphKey, *, reference: LastRun | None = None) -> Recorded:
        """Stage the key's dummy batch, warm up, capture; the key's outcome and graph (None: skipped).

        `reference`: keeps the real rows of the last plain warmup (an eager run of the dummy batch, with the
        same reads as a run right after it), for the verifier to compare the dummy batch's replay with (when it
        was the batch's first run, the verifier compares again with an eager run after the replay where they
        differ).
        """
        parts = self.parts
        backend = parts.backend
        start = time.perf_counter()
        eager_seconds = 0.0
        graph: CapturedGraph | None = None
        failure: Exception | None = None
        mode = parts.registry.mode_of(key)
        try:
            with parts.segment():
                batch = self.capture_batch(key)
                counts = dummy_counts(batch)
                with failing_in("the staging", counts):
                    inputs = parts.stage(batch, key, phase="capture", dummy=True)
                warmups = parts.config.capture.num_warmups
                # A full graph recorded under the preflight's checks (`checks_in_capture`) is checked there, once;
                # with no plain warmup the preflight still runs, so the recording is never the key's first run.
                checked = mode is Mode.PIECEWISE or not backend.checks_in_capture or warmups == 0
                run = self.warmup_run(inputs, mode)
                if reference is not None and warmups > 0:
                    keep = lambda out: parts.outputs.real(cloned(out), inputs)  # noqa: E731
                    run = reference.around(run, int(checked) + warmups, backend, keep)
                t0 = time.perf_counter()
                with failing_in("a warmup run", counts):
                    backend.warmup(run, warmups, checked=checked)
                    backend.synchronize()  # time the warmups' GPU work, not their launches
                eager_seconds += time.perf_counter() - t0
                statics = parts.static_inputs(inputs)
                # the graph's reads guarded, a tensor the forward keeps anew on every call refused
                seen = watch_recording(parts.guard, parts.model, parts.buffers.storage(), str(key))
                with failing_in("the recording", counts):
                    graph = self._capture(key, inputs, mode, statics)
                    seen(graph)
                    self._check_outputs(key, graph, inputs)
        except (KeyboardInterrupt, SystemExit):
            if graph is not None:
                graph.release()
            raise
        except Exception as exc:  # any failure of one key is handled the same way below
            failure = exc
        reason = parts.failures.settle(f"capturing {key}", failure, graph)
        seconds = time.perf_counter() - start
        if reason is not None or graph is None:
            return Recorded(
                KeyOutcome(key, "skipped", seconds, message=reason or "", eager_seconds=eager_seconds), None
            )
        pieces, calls = getattr(graph, "num_pieces", 1), len(getattr(graph, "calls", ()))
        outcome = KeyOutcome(
            key, "captured", seconds, graph.memory_bytes, eager_seconds=eager_seconds, pieces=pieces, eager_ops=calls
        )
        return Recorded(outcome, graph)

    def _capture(self, key: GraphKey, inputs: ForwardInputs, mode: Mode, statics: Mapping[str, Any]) -> CapturedGraph:
        """The backend's capture of `key` on the staged `inputs`: a full graph, or pieces cut at each eager op."""
        backend = self.parts.backend
        if mode is not Mode.PIECEWISE:
            return backend.capture(self.reference_run(inputs, mode), statics, name=str(key))
        forward = self.forward

        def run_pieces(session: Any) -> StepOutput:
            with running(inputs, "piecewise", session):
                return forward(inputs)

        return backend.capture_pieces(run_pieces, statics, name=str(key))

    def _check_outputs(self, key: GraphKey, graph: CapturedGraph, inputs: ForwardInputs) -> None:
        """The graph's output has the rows `model.output_rows` declares, and (with verification off) no
        undeclared output whose cut its shape leaves open."""
        outputs = self.parts.outputs
        outputs.real(graph.output, inputs)
        why = None if self.parts.config.checks.verify_replay else outputs.ambiguity(graph.output, key)
        if why is not None:
            raise CaptureError(why)

    def stage_dummy(self, key: GraphKey) -> ForwardInputs:
        """`key`'s dummy batch staged as its warmups stage it."""
        return self.parts.stage(self.capture_batch(key), key, phase="capture", dummy=True)

    def key_run(self, key: GraphKey) -> Run:
        """The forward of `key`'s graph on its dummy batch, staged as its warmups stage it (not run here)."""
        return self.reference_run(self.stage_dummy(key), self.parts.registry.mode_of(key))

    def capture_batch(self, key: GraphKey) -> StepBatch:
        """The dummy batch that captures (and first verifies) `key`, with sampled engine-buffer rows."""
        shape = self.parts.registry.capture_shape(key)
        return self.sampled(dummy_batch(shape, max_model_len=self.parts.config.kv_cache.max_model_len), 0)

    def reference_run(self, inputs: ForwardInputs, mode: Mode) -> Run:
        """The forward a key's graph holds: a full graph runs the eager ops' capturable stand-ins;
        a piecewise key's reference is the plain eager forward."""
        forward = self.forward
        phase: Phase = "eager" if mode is Mode.PIECEWISE else "full"

        def run() -> StepOutput:
            with running(inputs, phase):
                return forward(inputs)

        return run

    def warmup_run(self, inputs: ForwardInputs, mode: Mode) -> Run:
        """The warmup of a key. A piecewise key's eager ops run outside the checks (their bodies never
        run in a graph), and the code between them may not read request metadata (`forbidden_reads`)."""
        if mode is not Mode.PIECEWISE:
            return self.reference_run(inputs, mode)
        forward = self.forward

        def run() -> StepOutput:
            with running(inputs, "piecewise_warmup", _WARMUP_SESSION), forbidden_reads(inputs):
                return forward(inputs)

        return run

    def sampled(self, batch: StepBatch, seed: int, axes: Mapping[str, int] | None = None) -> StepBatch:
        """`batch` with sampled real rows for every engine buffer that is sampled (`BufferSpec.is_sampled`),
        stating `axes` (None: its own). Seed 0: the batch a key is recorded with (`capture_batch`)."""
        axes = batch.axes if axes is None else axes
        specs = self.parts.extras
        samples = any(spec.is_sampled for spec in specs)
        if not samples and axes == batch.axes:
            return batch
        extras = batch.extras
        if samples:
            rng = np.random.default_rng([seed, batch.num_tokens, batch.num_reqs])
            extras = sampled(specs, rng, batch.num_tokens, batch.num_reqs, axes, capture=seed == 0)
        q, s, ids, table = batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table
        return StepBatch(q, s, ids, table, extras=extras, kv_groups=batch.kv_groups, axes=axes)


def capture_reqs(registry: KeyRegistry, key: GraphKey) -> int:
    """The padded requests of the batches that capture and verify `key` (`KeyRegistry.capture_shape`: a piecewise
    key's are as many as a step of its size can have)."""
    num_reqs = registry.capture_shape(key).num_reqs
    return key.num_tokens if num_reqs is None else num_reqs  # a capture shape always states it


def dummy_counts(batch: StepBatch) -> str:
    """How a failure names a key's dummy batch: "its dummy batch (8 tokens, 8 requests)"."""
    return f"its dummy batch ({batch.num_tokens} tokens, {batch.num_reqs} requests)"


class WarmupSession:
    """The session of a piecewise key's warmup: an eager op's body runs outside the checks (it never runs
    in a graph, so it may do what a graph cannot hold, host syncs included)."""

    @staticmethod
    def run_eager(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with outside_checks():
            return fn(*args, **kwargs)


_WARMUP_SESSION = WarmupSession()
