"""`CaptureManager`: capture every planned key, then dispatch, stage, check and replay each step.

Capture walks the keys largest first. For each key a dummy batch goes through the same
`PersistentBuffers.stage` as real steps, its invariants are checked, the model runs
`num_warmups` times eagerly and the backend captures, all inside the engine's
`capture_context`. After the context exits (an engine registers its graph buffers there),
each graph is verified (`checks.verify_replay`): one replay of the dummy batch and one of a
partly filled probe batch, each compared with an eager run. A pass is all or nothing under
`capture.on_error: raise`; under `skip` a failing key is recorded and runs eagerly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from graphcap.backends import CapturedGraph, GraphBackend, get_backend, resolve_device
from graphcap.batch import StepBatch, scratch_block_ids
from graphcap.block_table import BlockTable
from graphcap.capture import CapturePass, gc_frozen, uncompiled_warnings
from graphcap.communicators import Communicator, communicators_of, key_captured_hook, pass_context
from graphcap.config import CaptureConfig
from graphcap.distributed import StepAgreement, counts_buffers, or_idle
from graphcap.errors import CaptureError, ConfigError, ConfigProblem, InvariantViolation
from graphcap.failures import FailurePolicy
from graphcap.guard import StaticGuard
from graphcap.inputs import BufferSpec, ForwardInputs, PreparePhase, prepare_of
from graphcap.invariants import check_invariants
from graphcap.keys import Dispatch, GraphKey, KeyRegistry, Mode, StepStats
from graphcap.outputs import real_rows
from graphcap.phases import STEP_PHASES, in_phase
from graphcap.piecewise import running
from graphcap.report import CaptureReport, GraphRecord, check_report_path, format_bytes
from graphcap.staging import PersistentBuffers

__all__ = ["CaptureManager"]

log = logging.getLogger("graphcap")


class CaptureManager:
    """Owns the persistent buffers, the key registry and the graphs of one model.

    Thread-safe: `execute`, `eager`, `dispatch` and `capture` hold one lock (`lock`), so two
    threads never interleave staging and replay. The tensor `execute` returns is a view of
    the graph's static output: valid until the next step (clone it to keep it), as on every
    engine; with several threads, hold `lock` until you have read or cloned it.
    Does not schedule, sample or manage KV blocks: the engine owns those.
    """

    def __init__(
        self,
        model: Any,
        config: CaptureConfig,
        backend: str | GraphBackend = "auto",
        group: Any = None,
        *,
        progress: bool | None = None,
        dp_timeout: float = 300.0,
        buffers: Iterable[BufferSpec] = (),
        capture_context: Callable[[], AbstractContextManager] | None = None,
        device: torch.device | str | None = None,
        tp_group: Any = None,
        pad_eager: bool = False,
        dp_token_counts: bool = False,
        communicators: Iterable[Communicator] = (),
    ) -> None:
        if not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must have a callable forward(inputs); got {type(model).__name__}")
        self._communicators = communicators_of(communicators)
        self._capture_context = pass_context(capture_context, self._communicators)
        """Entered around the captures of a pass, verification after it exits (an engine's
        `graph_capture()` that sets up custom all-reduce buffers and registers them at exit)."""
        self.model = model
        self.config = config
        self.device = resolve_device(config) if device is None else torch.device(device)
        extras = (*_buffer_specs(config, buffers), *counts_buffers(group, dp_token_counts))
        self.buffers = PersistentBuffers.from_config(config, self.device, extras=extras)
        self.registry = KeyRegistry.from_config(config)
        # A backend passed in may hold other managers' graphs: only one built here is reset.
        self._owns_backend = not isinstance(backend, GraphBackend)
        self.backend = (
            get_backend(backend, self.device, sync_debug=config.checks.sync_debug) if self._owns_backend else backend
        )
        self.graphs: dict[GraphKey, CapturedGraph] = {}
        self.stats = StepStats()
        self.progress = progress
        self._level = config.checks.invariants
        self._forward: Callable[[ForwardInputs], Any] = model.forward
        self._prepare = prepare_of(model)
        self._lock = threading.RLock()
        self._peers = StepAgreement.create(  # DP (group) and TP peers, or None; agrees on the config first
            config, self.registry, self.buffers, group, tp_group, dp_timeout, pad_eager, dp_token_counts
        )
        self._failures = FailurePolicy(config.capture.on_error, self._peers)
        self._counting = True
        self._in_step: str | None = None
        self._guard = StaticGuard()
        self.last_key: GraphKey | None = None
        """The key the last `execute`/`eager` step ran with (a captured key, or the unpadded
        eager key); read it instead of dispatching the same batch twice."""

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Steps inside are not counted in `stats` (benchmarks, health checks)."""
        with self._lock:
            was, self._counting = self._counting, False
            try:
                yield
            finally:
                self._counting = was

    @property
    def block_table(self) -> BlockTable:
        """The persistent block table: rows written as they change, named by a step instead of a fresh table.

        `manager.block_table.set_row(i, blocks)` / `append` / `move` / `swap` / `clear` as requests
        come, grow, move and go; `StepBatch(q, s, ids, block_table=manager.block_table)` then reads
        request i's blocks from row i (see `BlockTable`). With several threads, write rows under
        `lock`. A capture pass sets the rows aside and puts them back.
        """
        return self.buffers.block_table

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every step and capture holds.

        Hold it around `execute` and the use of its result when several threads share the
        manager: another thread's next step overwrites the returned view.
        """
        return self._lock

    # -- capture -------------------------------------------------------------------------

    def capture(self, *, scratch_blocks: Iterable[int] = ()) -> CaptureReport:
        """Capture every planned key (largest first), verify each, and return the report.

        Replaces graphs from an earlier pass. `capture.on_error: raise`: the first failure releases
        every graph of this pass and raises `CaptureError` naming the key and a hint; `skip`: the key
        is recorded as skipped and runs eagerly. A sticky CUDA error ends the pass under either
        policy. On every exit path GC is restored and no partial graph stays registered.
        `ConfigError` when `capture.num_warmups` is below what the backend needs (cuda: 1), or when
        `report.path` cannot be written (checked first; the report is written atomically after).

        The pass writes graphcap's persistent buffers, the null block 0 of the KV cache, what the
        model writes for pad-slot tokens, and the `scratch_blocks` (free block ids from the engine,
        where verification then writes its keys and values); nothing else the engine owns, so a
        re-capture mid-serving leaves every live KV block bit-identical (README: "What capture()
        writes").
        """
        report_path = self.config.report.path
        if report_path:
            check_report_path(report_path)
        scratch = scratch_block_ids(scratch_blocks, self.config.kv_cache.num_blocks)
        with self._lock, self._step("capture"):
            self._check_warmups()
            if self._peers is not None:  # a rank that steps while its peers capture fails here, out of step
                self._peers.begin_capture()
            self._release_all()
            self._guard.arm(self._guard.collect(self.model, self.buffers.storage()), self.model)
            start = time.perf_counter()
            try:
                with gc_frozen(), logging_redirect_tqdm(), self.buffers.table_set_aside():
                    self.backend.empty_cache()  # once per pass; the graphs then share the pool
                    memory_before = self.backend.memory_in_use()
                    job = self._capture_pass(scratch)
                    records, graphs = job.run(
                        self.registry.capture_order(), context=self._capture_context, progress=self.progress
                    )
            except BaseException:
                self._release_all()
                raise
            self._install(records, graphs)
            report = CaptureReport(
                records=records,
                backend=self.backend.name,
                device=str(self.device),
                total_seconds=time.perf_counter() - start,
                pool_bytes=max(0, self.backend.memory_in_use() - memory_before),
                config=self.config.to_dict(),
                warnings=uncompiled_warnings(self.graphs.values(), self.backend.name),
            )
            if report_path:
                self._write_report(report, report_path)
        log.info(
            "captured %d graphs in %.2f s (%s)",
            len(report.captured),
            report.total_seconds,
            format_bytes(report.pool_bytes),
        )
        return report

    def _capture_pass(self, scratch_blocks: tuple[int, ...] = ()) -> CapturePass:
        return CapturePass(
            backend=self.backend,
            registry=self.registry,
            config=self.config,
            stage=self._stage,
            forward=self._forward,
            static_inputs=self._static_inputs,
            extras=self.buffers.extras,
            failures=self._failures,
            scratch_blocks=scratch_blocks,
            on_captured=key_captured_hook(self._communicators),
        )

    def _install(self, records: list[GraphRecord], graphs: dict[GraphKey, CapturedGraph]) -> None:
        """Keep what a pass produced: its graphs (captured and verified), and the keys it skipped."""
        self.graphs.update(graphs)
        for record in records:
            if record.key in graphs:
                self.registry.mark_captured(record.key)
            elif record.status == "skipped":
                self.registry.mark_skipped(record.key, record.reason)

    def _write_report(self, report: CaptureReport, path: str) -> None:
        try:
            report.write(path)
        except BaseException as exc:  # the pass is all or nothing: undo it, as for a failed key
            self._release_all()
            if not isinstance(exc, Exception):
                raise
            raise CaptureError(
                f"captured {len(report.captured)} graphs, but writing the report to {path} failed "
                f"({type(exc).__name__}: {exc}); the graphs were released, the old report is unchanged"
            ) from exc

    def _check_warmups(self) -> None:
        """A backend that needs plain warmups before capture (cuda) refuses `num_warmups: 0`."""
        try:
            self.backend.check_warmups(self.config.capture.num_warmups)
        except ValueError as exc:
            raise ConfigError([ConfigProblem("capture.num_warmups", str(exc))]) from None

    # -- steps ---------------------------------------------------------------------------

    def dispatch(self, batch: StepBatch | None, *, step: int | None = None) -> GraphKey | None:
        """The captured key `batch` replays with, or None (eager). Collective with peers (`step`: see `execute`)."""
        batch = or_idle(batch)
        with self._lock, self._step("dispatch"):  # with a group, a step's collective must not interleave
            mode, key, _ = self._dispatch(batch, step)
            return None if mode is Mode.EAGER else key

    def execute(self, batch: StepBatch | None, *, step: int | None = None) -> Any:
        """Run one step: dispatch, stage, prepare, check invariants, replay or run eagerly.

        Before every replay the static inputs are checked (`StaticInputMovedError` when one
        moved since capture). Returns what the forward returns (a tensor, or a tuple, list or
        dict of tensors) with every tensor whose leading dim is the padded token count cut to
        the real rows `[:batch.num_tokens]`: views valid until any graph of the backend's pool
        replays (the next step), so read or clone them first. `None` is an idle data-parallel
        rank: it joins the agreed key with no real rows (so does a batch refused with peers, then raises).
        `step`: the engine's step number, which peers must share (default: this manager's count of steps).
        """
        batch = or_idle(batch)
        with self._lock, self._step("execute"):
            peers = self._peers  # with peers: agreed first; a refused batch runs the step idle, then raises
            return self._run(batch, self._dispatch(batch)) if peers is None else peers.execute(batch, self._run, step)

    def _run(self, batch: StepBatch, dispatch: Dispatch) -> Any:
        mode, key, reason = dispatch
        if mode is Mode.EAGER:
            output = self._run_eager(batch, key)
            if self._counting:  # after the run: a refused batch is no step
                self.stats.eager[reason] += 1
            return output
        self.last_key = key
        inputs = self._stage(batch, key, phase="replay")
        graph = self.graphs[key]
        self._guard.check(sweep=self._level != "off")
        if mode is Mode.PIECEWISE:  # eager ops between pieces read the step through current_inputs()
            with running(inputs):
                output = graph.replay()
        else:  # a full graph runs no Python: skip the context (about 1 us per step)
            output = graph.replay()
        if self._counting:
            stats = self.stats
            stats.graph_hits[key] += 1
            stats.real_tokens += batch.num_tokens
            stats.padded_tokens += key.num_tokens
            if mode is Mode.PIECEWISE:
                stats.eager_op_calls += len(graph.calls)
                stats.eager_op_copies += graph.copies_per_replay
        return real_rows(output, batch.num_tokens, key.num_tokens)

    def eager(self, batch: StepBatch) -> Any:
        """The reference: the model on the same staging path, unpadded, with no graph."""
        batch = or_idle(batch)
        with self._lock, self._step("eager"):
            return self._run_eager(batch)

    def _run_eager(self, batch: StepBatch, key: GraphKey | None = None) -> Any:  # key: unpadded, or pad_eager's
        key = key or self.registry.eager_key(batch.num_tokens, batch.num_reqs)
        self.last_key = key
        with in_phase("eager"):
            inputs = self._stage(batch, key, phase="eager")
            with torch.inference_mode(), running(inputs):
                output = self._forward(inputs)
        return real_rows(output, batch.num_tokens, key.num_tokens, what="model.forward (eager) of")

    def _stage(
        self, batch: StepBatch, key: GraphKey, *, phase: PreparePhase, dummy: bool = False, kv_writes: bool = True
    ) -> ForwardInputs:
        """The one staging path of capture, replay and eager: stage, let the model plan, prove, upload.

        The invariants run after `prepare`, on the host rows the upload then copies, so nothing
        `prepare` writes reaches a graph unchecked; rows found broken are all rewritten by the next
        step. `dummy`: a batch graphcap made (its requests share the null block by design).
        `kv_writes=False`: a verification batch that reads live blocks; its real tokens get the
        pad slot, so the forward writes no KV slot an engine's request may own.
        """
        buffers = self.buffers
        inputs = buffers.stage(batch, key, upload=False)
        if self._peers is not None:
            self._peers.write_counts(inputs)
        if not kv_writes:
            inputs.host.slot_mapping[: inputs.num_tokens] = buffers.limits.pad.slot
        if self._prepare is not None:
            self._prepare(inputs, phase)
        try:
            check_invariants(inputs, self._level, dummy=dummy or batch.block_table is None, kv_writes=kv_writes)
        except InvariantViolation:
            buffers.forget_padding()  # something other than staging wrote the rows
            raise
        buffers.upload()  # the rows just staged and checked
        return inputs

    def _dispatch(self, batch: StepBatch, step: int | None = None) -> Dispatch:
        if self._peers is not None:
            return self._peers.plan(batch, "dispatch", step).dispatch
        registry = self.registry
        return registry.dispatch(batch.num_tokens, batch.num_reqs, batch.is_uniform(registry.uniform_query_len))

    # -- bookkeeping ---------------------------------------------------------------------

    def register_static(self, name: str, tensor: torch.Tensor) -> None:
        """Add a tensor the graphs read that is not a parameter or buffer of an `nn.Module` model.

        A KV cache held in a plain list (as vLLM holds it), a plain tensor attribute, any tensor
        of a non-Module model, an engine buffer: registered tensors are address-checked like
        parameters, at capture and before every replay, and errors name them (`static.NAME`).
        Register before `capture()`. Registering `name` again with a tensor at another address,
        or replacing a registered tensor's storage (`t.data = ...`, `set_`), makes every replay
        raise `StaticInputMovedError` until `capture()` runs again. A name first registered
        after capture is checked from then on at its current address.
        """
        with self._lock:
            self._guard.register(name, tensor)

    def _static_inputs(self, inputs: ForwardInputs) -> dict[str, torch.Tensor]:
        return self._guard.collect(self.model, inputs.tensors())

    @contextmanager
    def _step(self, what: str) -> Iterator[None]:
        """Refuse a step started from inside another one (prepare() or forward() calling back)."""
        if self._in_step is not None:
            raise CaptureError(
                f"manager.{what}() was called from inside {self._in_step}() (from the model's prepare() or "
                "forward()); steps do not nest: it would restage the persistent buffers under the outer "
                f"step. Call {what}() outside the model, after the outer step returns"
            )
        self._in_step = what
        try:
            with in_phase(STEP_PHASES.get(what, "outside")):  # graphcap.phase(); eager runs and passes narrow it
                yield
        finally:
            self._in_step = None

    def _release_all(self) -> None:
        """Drop every graph of this manager and, when the backend is ours, its memory pool."""
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self.registry.reset()
        self._guard.disarm()
        if self._owns_backend:
            self.backend.reset()

    def reset(self) -> None:
        """Release every graph; later steps run eagerly until `capture()` runs again."""
        with self._lock, self._step("reset"):
            self._release_all()

    def __repr__(self) -> str:
        return f"CaptureManager({len(self.graphs)} graphs, backend={self.backend.name}, device={self.device})"


def _buffer_specs(config: CaptureConfig, buffers: Iterable[BufferSpec]) -> tuple[BufferSpec, ...]:
    """The engine buffers: those of the config's `buffers:` list, then those passed in."""
    if isinstance(buffers, BufferSpec) or not isinstance(buffers, Iterable):
        raise TypeError(f"buffers must be a list of graphcap.BufferSpec; got {type(buffers).__name__}")
    return (*map(BufferSpec.from_config, config.buffers), *buffers)
