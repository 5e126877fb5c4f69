"""`CapturePass`: capture and verify the keys of one model, with everything it needs passed in.

For a key: its dummy batch goes through the manager's one staging path, the forward is warmed
up, the backend captures (a full graph, or pieces cut at each `eager_op`), and the failure
policy settles a failure. Verification (after the engine's capture context has exited) replays
the dummy batch and probe batches at several fill levels, each against an eager run of it. The manager
owns the graphs and the registry's capture state; a pass only produces them.

GC is held still around a pass by its caller (`graphcap.capture.gc_hold`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from graphcap.backends import CapturedGraph, GraphBackend
from graphcap.backends.pieces import forbidden_reads
from graphcap.backends.preflight import outside_checks
from graphcap.batch import StepBatch, dummy_batch
from graphcap.capture.axes import verify_axes
from graphcap.capture.failures import FailurePolicy
from graphcap.capture.probing import SharedReferences, expected_probes, verify_dummy, verify_probes
from graphcap.capture.timing import replay_speedup
from graphcap.capture.verification import LastRun, compare_replay
from graphcap.config import CaptureConfig
from graphcap.config.byte_counts import format_bytes
from graphcap.errors import CaptureError
from graphcap.inputs import BufferSpec, ForwardInputs, KVGroup
from graphcap.keys import GraphKey, KeyRegistry, Mode
from graphcap.outputs import OutputRows, cloned
from graphcap.phases import in_phase
from graphcap.piecewise import running
from graphcap.probe import Fill
from graphcap.report import GraphRecord
from graphcap.staging.extras import sampled

__all__ = ["CapturePass", "progress_bar", "uncompiled_warnings"]


@dataclass
class CapturePass:
    """What capturing and verifying keys needs, given explicitly (the manager builds one per pass).

    `stage(batch, key, phase=, dummy=, kv_writes=)`: the manager's staging path (stage, the
    model's `prepare`, the invariants, the upload). `forward`: the model's forward.
    `static_inputs(inputs)`: every tensor the graph reads, by name. `scratch_blocks`: KV blocks
    the verification batch may write (see `probe_batch`). `outputs`: the model's `output_rows`, which
    cut every result compared; with verification off, a key whose undeclared outputs' cut no shape
    settles is refused (`OutputRows.ambiguity`).
    """

    backend: GraphBackend
    registry: KeyRegistry
    config: CaptureConfig
    stage: Callable[..., ForwardInputs]
    forward: Callable[[ForwardInputs], Any]
    static_inputs: Callable[[ForwardInputs], dict]
    extras: tuple[BufferSpec, ...]
    failures: FailurePolicy
    outputs: OutputRows
    scratch_blocks: tuple[int, ...] = ()
    kv_groups: tuple[KVGroup, ...] = ()
    group_scratch: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    timer: Callable[[], float] | None = None
    """What times each key's replay against eager (`replay_speedup`); None: CUDA events or perf_counter."""
    on_captured: Callable[[GraphKey], None] | None = None
    """Called with each key right after its graph is captured (communicators register its buffers)."""
    precision: torch.dtype | None = None
    """The model's lowest floating parameter dtype: a 16-bit one sets how verification judges outputs."""
    ledger: Any = None
    """With peers (not on CUDA), the manager's `CollectiveLedger`: each key's capture and verification is one of
    its segments, so a rank failing part-way issues what its peers still wait in before the key's agreement."""
    watch: Callable[[GraphKey], Callable[[CapturedGraph], None]] | None = None
    """Called before each key's capture; what it returns is called with the graph, and may refuse it
    (`graphcap.checks.recorded.watch_recording`: the graph's reads guarded, a tensor kept per call refused)."""
    references: SharedReferences = dataclasses.field(init=False)
    """The eager results of probe batches that later keys of this pass probe again (off with peers)."""

    def __post_init__(self) -> None:
        alone = self.failures.peers is None and self.ledger is None and not _in_world()
        self.references = SharedReferences(alone)

    def run(
        self, keys: Iterable[GraphKey], *, context: Callable[[], AbstractContextManager], progress: bool | None
    ) -> tuple[list[GraphRecord], dict[GraphKey, CapturedGraph]]:
        """Capture `keys` in order inside `context()`, then (`checks.verify_replay`) verify each after it exits.

        Returns every key's record and the graphs that were captured and verified. On any
        exception the graphs captured so far are released before it propagates.
        """
        records: list[GraphRecord] = []
        graphs: dict[GraphKey, CapturedGraph] = {}
        verify = self.config.checks.verify_replay
        keys = list(keys)
        if verify:  # what a kept probe result is kept for
            self.references.expect(expected_probes(self, keys))
        # With no engine context to leave and no peers, each key is verified right after its capture, against
        # its last warmup's output (an eager run of the same batch): one forward less per key.
        inline = verify and context is contextlib.nullcontext and self.failures.peers is None
        try:
            with context():
                for key in progress_bar(keys, self.backend, progress):
                    full = self.registry.mode_of(key) is not Mode.PIECEWISE
                    reference = LastRun() if inline and full else None
                    record, graph = self.capture(key, reference=reference)
                    if graph is not None:
                        graphs[key] = graph
                        if self.on_captured is not None:
                            self.on_captured(key)
                    records.append(self._verified(record, graphs, reference) if inline else record)
            if verify and not inline:  # after the context: the engine registered its buffers
                records = [self._verified(record, graphs) for record in records]
            for i, record in enumerate(records):  # what each graph buys, timed again when a minimum decides
                if record.key in graphs and self.config.capture.min_speedup is not None:
                    with in_phase("verify"):  # graphcap's dummy batch, replayed and run eagerly
                        records[i] = self.measure(record, graphs[record.key])
                    if records[i].status == "skipped":
                        graphs.pop(record.key).release()
        except BaseException:
            for graph in graphs.values():
                graph.release()
            raise
        finally:
            self.references.clear()  # device memory, on CUDA: gone before the pass's growth is measured
        return records, graphs

    def capture(self, key: GraphKey, *, reference: LastRun | None = None) -> tuple[GraphRecord, CapturedGraph | None]:
        """Stage the key's dummy batch, warm up, capture. A failure is settled by the policy
        (raised, or the key recorded as skipped with no graph).

        `reference`: keeps the real rows of the last plain warmup (an eager run of the dummy batch, with the
        same reads as a run right after it), for `verify` to compare the dummy batch's replay with (when it was
        the batch's first run, `verify` compares again with an eager run after the replay where they differ).
        """
        start = time.perf_counter()
        eager_seconds = 0.0
        graph = failure = None
        mode = self.registry.mode_of(key)
        try:
            with self._segment():
                inputs = self.stage(self.capture_batch(key), key, phase="capture", dummy=True)
                warmups = self.config.capture.num_warmups
                # A full graph recorded under the preflight's checks (`checks_in_capture`) is checked there, once;
                # with no plain warmup the preflight still runs, so the recording is never the key's first run.
                checked = mode is Mode.PIECEWISE or not self.backend.checks_in_capture or warmups == 0
                run = self._warmup_run(inputs, mode)
                if reference is not None and warmups > 0:
                    run = reference.around(
                        run, int(checked) + warmups, self.backend, lambda out: self.outputs.real(cloned(out), inputs)
                    )
                t0 = time.perf_counter()
                self.backend.warmup(run, warmups, checked=checked)
                self.backend.synchronize()  # time the warmups' GPU work, not their launches
                eager_seconds += time.perf_counter() - t0
                statics = self.static_inputs(inputs)
                seen = self.watch(key) if self.watch is not None else None
                if mode is Mode.PIECEWISE:
                    forward = self.forward

                    def run_pieces(session: Any) -> Any:
                        with running(inputs, "piecewise", session):
                            return forward(inputs)

                    graph = self.backend.capture_pieces(run_pieces, statics, name=str(key))
                else:
                    graph = self.backend.capture(self._reference_run(inputs, mode), statics, name=str(key))
                if seen is not None:
                    seen(graph)
                self._check_outputs(key, graph, inputs)
        except (KeyboardInterrupt, SystemExit):
            if graph is not None:
                graph.release()
            raise
        except Exception as exc:  # any failure of one key is handled the same way below
            failure = exc
        reason = self.failures.settle(f"capturing {key}", failure, graph)
        seconds = time.perf_counter() - start
        if reason is not None:
            return GraphRecord(key, "skipped", seconds, 0, False, reason, eager_seconds), None
        pieces, calls = getattr(graph, "num_pieces", 1), len(getattr(graph, "calls", ()))
        record = GraphRecord(
            key, "captured", seconds, graph.memory_bytes, False, "", eager_seconds, pieces=pieces, eager_ops=calls
        )
        return record, graph

    def _segment(self) -> AbstractContextManager:
        """The ledger's segment around one key's capture or verification (nothing without a ledger)."""
        return self.ledger.segment() if self.ledger is not None else contextlib.nullcontext()

    def _verified(
        self, record: GraphRecord, graphs: dict[GraphKey, CapturedGraph], reference: LastRun | None = None
    ) -> GraphRecord:
        """`verify` in its phase; a graph the failure policy released leaves `graphs`."""
        with in_phase("verify"):
            record = self.verify(record, graphs.get(record.key), reference)
        if record.status == "skipped":
            graphs.pop(record.key, None)
        return record

    def verify(self, record: GraphRecord, graph: CapturedGraph | None, reference: LastRun | None = None) -> GraphRecord:
        """Replay the key's dummy batch, then a probe batch at each fill level (`probe_fills`), each against an
        eager run; the record is `verified` only when every one matched, its `verified_fills` the probes' counts.

        Collective with data-parallel ranks (every rank verifies every record, in order). A
        failure is settled by the policy: raised, or the record comes back skipped (the caller
        releases nothing: the policy released the graph).
        """
        key = record.key
        failure = None
        start, eager_seconds, timings, fills = time.perf_counter(), 0.0, {}, ()
        if graph is not None:
            try:
                with self._segment():
                    eager_seconds = self._verify_dummy(key, graph, timings, reference)
                    probe_seconds, fills = self._verify_probe(key, graph)
                    eager_seconds += probe_seconds
                    eager_seconds += verify_axes(self, key, graph)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:
                failure = exc
        elif record.status == "captured":
            failure = CaptureError(f"{key} has no graph to verify")
        self.references.abandon(key)  # its probes a failure left unrun count off
        reason = self.failures.settle(f"capturing {key}", failure, graph)
        seconds = record.capture_seconds + time.perf_counter() - start
        if reason is not None:
            return dataclasses.replace(
                record, status="skipped", capture_seconds=seconds, memory_bytes=0, reason=reason, pieces=0, eager_ops=0
            )
        if graph is None:
            return record
        eager_seconds += record.eager_seconds
        speedup = timings["eager"] / timings["replay"] if timings.get("replay") else None  # one sample each
        return dataclasses.replace(
            record,
            verified=True,
            capture_seconds=seconds,
            eager_seconds=eager_seconds,
            speedup=speedup,
            verified_fills=tuple(tuple(fill) for fill in fills),
        )

    def measure(self, record: GraphRecord, graph: CapturedGraph) -> GraphRecord:
        """Time the key's replay against an eager run of its dummy batch (`replay_speedup`: the medians of a
        few interleaved runs) into `speedup`; run when `capture.min_speedup` is set (without it, `speedup`
        is the one sample of each side the dummy batch's verification took). Below `capture.min_speedup` (on
        any data-parallel rank) the record comes back skipped with the reason `no_speedup: ...`; the caller
        releases the graph.
        """
        key = record.key
        inputs = self.stage(self.capture_batch(key), key, phase="capture", dummy=True)
        eager = self._reference_run(inputs, self.registry.mode_of(key))

        def replay() -> None:
            with running(inputs):
                graph.replay()

        with torch.inference_mode():
            speedup = replay_speedup(replay, eager, self.backend, timer=self.timer)
        least, peers = self.config.capture.min_speedup, self.failures.peers
        slow, peer = least is not None and speedup < least, False
        if least is not None and peers is not None:  # ranks keep the same keys: one slow rank drops it everywhere
            first = peers.first_failed(slow, "key", f"{key}: capture.min_speedup")
            slow, peer = first is not None, first is not None and not slow
        if not slow:
            return dataclasses.replace(record, speedup=speedup)
        why = "another data-parallel rank's replay was" if peer else f"replay {speedup:.2f}x as fast as eager,"
        reason = f"no_speedup: {why} below capture.min_speedup {least:g} (the graph was released)"
        return dataclasses.replace(
            record, status="skipped", memory_bytes=0, reason=reason, speedup=speedup, pieces=0, eager_ops=0
        )

    def _check_outputs(self, key: GraphKey, graph: CapturedGraph, inputs: ForwardInputs) -> None:
        """The graph's output has the rows `model.output_rows` declares, and (with verification off) no
        undeclared output whose cut its shape leaves open."""
        self.outputs.real(graph.output, inputs)
        why = None if self.config.checks.verify_replay else self.outputs.ambiguity(graph.output, key)
        if why is not None:
            raise CaptureError(why)

    def compare(self, graph: CapturedGraph, inputs: ForwardInputs, eager: Callable[[], Any], **options: Any) -> float:
        """`compare_replay` at this pass's tolerance, backend, output rows and precision; `options`: its
        `message`, `timings` and `diagnose`."""
        return compare_replay(
            graph,
            inputs,
            eager,
            tolerance=self.config.checks.tolerance,
            backend=self.backend,
            outputs=self.outputs,
            precision=self.precision,
            **options,
        )

    def key_run(self, key: GraphKey) -> Callable[[], Any]:
        """The forward of `key`'s graph on its dummy batch, staged as its warmups stage it (not run here)."""
        inputs = self.stage(self.capture_batch(key), key, phase="capture", dummy=True)
        return self._reference_run(inputs, self.registry.mode_of(key))

    def capture_batch(self, key: GraphKey) -> StepBatch:
        """The dummy batch that captures (and first verifies) `key`, with sampled engine-buffer rows."""
        shape = self.registry.capture_shape(key)
        return self._sampled(dummy_batch(shape, max_model_len=self.config.kv_cache.max_model_len), 0)

    def _verify_dummy(
        self, key: GraphKey, graph: CapturedGraph, timings: dict | None = None, reference: LastRun | None = None
    ) -> float:
        """Replay the key's dummy batch against an eager run of it (`probing.verify_dummy`); eager seconds."""
        return verify_dummy(self, key, graph, timings, reference)

    def _verify_probe(self, key: GraphKey, graph: CapturedGraph) -> tuple[float, tuple[Fill, ...]]:
        """Verify `key` on a probe batch at each of `probe_fills(key)` (`probing.verify_probes`)."""
        return verify_probes(self, key, graph)

    def _reference_run(self, inputs: ForwardInputs, mode: Mode) -> Callable[[], Any]:
        """The forward a key's graph holds: a full graph runs the eager ops' capturable stand-ins;
        a piecewise key's reference is the plain eager forward."""
        forward, phase = self.forward, "eager" if mode is Mode.PIECEWISE else "full"

        def run() -> Any:
            with running(inputs, phase):
                return forward(inputs)

        return run

    def _warmup_run(self, inputs: ForwardInputs, mode: Mode) -> Callable[[], Any]:
        """The warmup of a key. A piecewise key's eager ops run outside the checks (their bodies never
        run in a graph), and the code between them may not read request metadata (`forbidden_reads`)."""
        if mode is not Mode.PIECEWISE:
            return self._reference_run(inputs, mode)
        forward = self.forward

        def run() -> Any:
            with running(inputs, "piecewise_warmup", _WARMUP_SESSION), forbidden_reads(inputs):
                return forward(inputs)

        return run

    def _sampled(self, batch: StepBatch, seed: int, axes: Mapping[str, int] | None = None) -> StepBatch:
        """`batch` with sampled real rows for every engine buffer that is sampled (`BufferSpec.is_sampled`),
        stating `axes` (None: its own)."""
        axes = batch.axes if axes is None else axes
        samples = any(spec.is_sampled for spec in self.extras)
        if not samples and axes == batch.axes:
            return batch
        extras = batch.extras
        if samples:
            rng = np.random.default_rng([seed, batch.num_tokens, batch.num_reqs])
            extras = sampled(self.extras, rng, batch.num_tokens, batch.num_reqs, axes)
        q, s, ids, table = batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table
        return StepBatch(q, s, ids, table, extras=extras, kv_groups=batch.kv_groups, axes=axes)


class WarmupSession:
    """The session of a piecewise key's warmup: an eager op's body runs outside the checks (it never runs
    in a graph, so it may do what a graph cannot hold, host syncs included)."""

    @staticmethod
    def run_eager(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with outside_checks():
            return fn(*args, **kwargs)


_WARMUP_SESSION = WarmupSession()


def _in_world() -> bool:
    """Whether this process is one rank of several (`torch.distributed`, initialized, more than one rank)."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def progress_bar(keys: list[GraphKey], backend: GraphBackend, progress: bool | None) -> Iterator[GraphKey]:
    """`keys`, with a progress bar on stderr naming the key and the free device memory (None: a terminal)."""
    disable = None if progress is None else not progress
    with tqdm(keys, desc="capture", unit="graph", file=sys.stderr, disable=disable, leave=False) as bar:
        for key in bar:
            free = backend.free_memory()
            bar.set_postfix_str(str(key) if free is None else f"{key} free {format_bytes(free)}", refresh=False)
            yield key


def uncompiled_warnings(graphs: Iterable[CapturedGraph], backend: str) -> list[str]:
    """What a report must say about a pass beyond its records: compiled code captured uncompiled."""
    uncompiled = sorted({f for graph in graphs for f in graph.uncompiled})
    if not uncompiled:
        return []
    return [
        f"torch.compile was off while the {backend} backend captured: {', '.join(uncompiled)} "
        "ran uncompiled in the graphs (eager steps run them compiled)"
    ]
