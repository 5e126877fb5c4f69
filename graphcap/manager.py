"""`CaptureManager`: capture the planned keys, then dispatch, stage, check and replay each step.

Upfront capture walks every key largest first before serving; lazy capture (`graphcap.capture.lazy`) serves
at once and captures in idle time. Either way the manager's `Capturer` (`graphcap.capture.capturer`) takes each
key: its dummy batch staged as real steps are, warmups, capture inside the engine's `capture_context`
(`Recorder`), verification after it exits (`Verifier`), within `capture.memory_budget` (`graphcap.memory.budget`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch

from graphcap.backends import CapturedGraph, GraphBackend, backend_for, resolve_device
from graphcap.backends.pieces import PiecewiseGraph
from graphcap.batch import StepBatch, step_or_idle
from graphcap.block_table import BlockTable
from graphcap.capture.capturer import Capturer
from graphcap.capture.failures import FailurePolicy
from graphcap.capture.lazy import LazyCapture
from graphcap.capture.lifecycle import KeptOutputs, LiveGraphs, PassHistory, check_kv_fits, resize_plan
from graphcap.capture.parts import CaptureParts, Forward, PartOf
from graphcap.checks.guard import StaticGuard
from graphcap.checks.invariants import check_invariants
from graphcap.checks.sampling import Expected, StepSampler, locate
from graphcap.communicators import Communicator, communicators_of, pass_context
from graphcap.config import CaptureConfig
from graphcap.distributed import StepAgreement, counts_buffers
from graphcap.distributed.ledger import CollectiveLedger
from graphcap.distributed.options import Parallel, parallel_of
from graphcap.errors import InvariantViolation
from graphcap.inputs import BufferSpec, ForwardInputs, PreparePhase, prepare_of
from graphcap.keys import NOT_CAPTURED_WARNING, Dispatch, GraphKey, KeyRegistry, Mode, StepStats
from graphcap.memory.budget import MemoryBudget
from graphcap.memory.estimate import GraphMemory
from graphcap.model_facts import VOCAB_HINT, check_model_device, is_built_in, precision_of, with_model_vocab
from graphcap.outputs import OutputRows, StepOutput
from graphcap.phases import in_phase
from graphcap.piecewise import running
from graphcap.postmortem.hook import PostMortem, flight_recorder
from graphcap.report import CaptureReport
from graphcap.staging import PersistentBuffers
from graphcap.staging.extras import merged_specs
from graphcap.step_scope import StepScope

__all__ = ["CaptureManager"]

log = logging.getLogger("graphcap")


class CaptureManager:
    """Owns the persistent buffers, the key registry and the graphs of one model.

    Thread-safe: `execute`, `eager`, `dispatch` and `capture` hold one lock (`lock`), so two
    threads never interleave staging and replay. The tensor `execute` returns is a view of
    the graph's static output: valid until the next step (clone it to keep it), as on every
    engine; with several threads, hold `lock` until you have read or cloned it.
    Does not schedule, sample or manage KV blocks: the engine owns those. `config.model.vocab_size` is
    read off the model when it declares its vocabulary (`graphcap.model_facts`); `manager.config` holds it.
    """

    # Held by the capture parts (one place: a pass reads what is set here, `resize_kv`'s config too).
    model: PartOf[Any] = PartOf("model")
    config: PartOf[CaptureConfig] = PartOf("config")
    _forward: PartOf[Forward] = PartOf("forward")
    _ledger: PartOf[CollectiveLedger | None] = PartOf("ledger")

    def __init__(
        self,
        model: Any,
        config: CaptureConfig,
        backend: str | GraphBackend = "auto",
        group: Any = None,
        *,
        parallel: Parallel | None = None,
        progress: bool | None = None,
        buffers: Iterable[BufferSpec] = (),
        capture_context: Callable[[], AbstractContextManager] | None = None,
        device: torch.device | str | None = None,
        communicators: Iterable[Communicator] = (),
        generators: Iterable[torch.Generator] = (),
    ) -> None:
        """`group`: the data-parallel group, shorthand for `parallel=Parallel(dp_group=group)`; `parallel`: every
        data- and tensor-parallel option (`graphcap.Parallel`).
        `generators`: the engine's own `torch.Generator`s its forward draws from (a sampler's), registered with
        every graph before its capture begins (`graphcap.backends.backend_for`)."""
        parallel = parallel_of(parallel, group)
        if not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must have a callable forward(inputs); got {type(model).__name__}")
        config, vocab_known = with_model_vocab(config, model)  # the model's own vocabulary, when it says it
        self._communicators = communicators_of(communicators)
        check_kv_fits(config, model)
        self.device = resolve_device(config) if device is None else torch.device(device)
        check_model_device(model, self.device, given=device is not None)  # before anything is allocated
        extras = (*merged_specs(config.buffers, buffers), *counts_buffers(parallel))
        self.buffers = PersistentBuffers.from_config(config, self.device, extras=extras)
        self.registry = KeyRegistry.from_config(config)
        self.backend, owns_backend = backend_for(backend, self.device, config, generators)
        self._guard = StaticGuard()
        self._live = LiveGraphs(self.backend, owns_backend, self.registry, self._guard)
        self.graphs: dict[GraphKey, CapturedGraph] = self._live.graphs
        self.stats = StepStats()
        self.progress = progress
        self._level = config.checks.invariants
        self._prepare = prepare_of(model)
        self._outputs = OutputRows.of(model)  # which output tensors are per token, per request or whole
        # DP and TP peers, or None; agrees on the config first (collective)
        self._peers = StepAgreement.create(config, self.registry, self.buffers, parallel, self._guard.check)
        around = [name for name, given in (("capture_context", capture_context), ("communicators", self._communicators))
                  if given]  # fmt: skip
        index_hint = None if vocab_known else VOCAB_HINT.format(vocab=config.model.vocab_size)
        failures = FailurePolicy(config.capture.on_error, self._peers, " and ".join(around), index_hint)
        # With peers, a capture forward that fails part-way issues the collectives its peers wait in (not on
        # CUDA: a dispatch mode around the warmups would change what torch.compile traces there).
        peers = self._peers
        ledger = (
            CollectiveLedger(peers.rank, peers.partners(), parallel.failure_timeout, self.device, serial=peers.ledger)
            if peers is not None and self.device.type != "cuda"
            else None
        )
        measure = None if is_built_in(model, config) else self._measure_key  # the model that is there
        self._budget = MemoryBudget(config, self.backend.name, measure)
        self._lazy = LazyCapture(self.registry, self.stats, self._peers, is_lazy=config.capture.strategy == "lazy")
        self._counting = True
        self._warned_not_captured = False
        self._history = PassHistory()
        self._kept = KeptOutputs()  # the last replay's outputs, kept valid across capture_pending()
        self._scope = StepScope(threading.RLock())
        self._flight = flight_recorder(config, self.buffers)  # the last staged steps, for a post-mortem
        if self._flight is not None:
            self._scope.on_failure = PostMortem(self, self._flight)
        every = config.checks.sample_every
        self._sampler = StepSampler(every) if every else None  # None: no cost on the replay path
        self.last_key: GraphKey | None = None
        """The key the last `execute`/`eager` step ran with: the captured key it replayed, or for an eager step
        `GraphKey(num_tokens, num_reqs, False)` of its own counts (with DP peers and padded eager steps: the
        counts every rank padded to, a key that may have a graph) (None before the first step). Public."""
        self._parts = CaptureParts(
            model=model,
            config=config,
            forward=model.forward,
            stage=self._stage,
            registry=self.registry,
            backend=self.backend,
            device=self.device,
            buffers=self.buffers,
            outputs=self._outputs,
            guard=self._guard,
            live=self._live,
            budget=self._budget,
            lazy=self._lazy,
            history=self._history,
            kept=self._kept,
            stats=self.stats,
            scope=self._scope,
            failures=failures,
            peers=self._peers,
            ledger=ledger,
            communicators=self._communicators,
            # Entered around a pass's captures, verification after it exits (an engine's `graph_capture()`).
            context=pass_context(capture_context, self._communicators),
            progress=progress,
        )
        self.capturer = Capturer(self._parts)
        """The capture half: `capture()`, `capture_pending()` and `pending()` delegate to it."""

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Steps inside are not counted in `stats` (benchmarks, health checks)."""
        with self._scope.lock:
            was, self._counting = self._counting, False
            try:
                yield
            finally:
                self._counting = was

    @property
    def block_table(self) -> BlockTable:
        """The persistent block table: rows written as they change (`set_row`, `append`, `truncate`, `move`, `swap`,
        `clear`), named by a step (`StepBatch(q, s, ids, block_table=manager.block_table)`: request i's blocks are
        row i) instead of a fresh table. With several threads, write rows under `lock`. A capture sets them aside."""
        return self.buffers.block_table

    @property
    def kv_group_tables(self) -> Mapping[str, BlockTable]:
        """Each extra KV-cache group's persistent block table by name (`kv_cache.groups`), kept as `block_table`."""
        return self.buffers.kv_groups.tables

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every step and capture holds: hold it around `execute` and the use of its result
        when several threads share the manager (another thread's next step overwrites the returned view)."""
        return self._scope.lock

    # -- capture (the capturer's) --------------------------------------------------------

    def capture(
        self, *, scratch_blocks: Iterable[int] = (), group_scratch_blocks: Mapping[str, Iterable[int]] | None = None
    ) -> CaptureReport:
        """Capture every planned key (largest first), verify each, and return the report.

        Replaces graphs from an earlier pass; under `capture.strategy: lazy` captures nothing (the report
        lists the pending keys; `capture_pending` captures them). `capture.on_error: raise`: the first
        failure releases every graph of this pass and raises `CaptureError` naming the key, a hint, and the run
        it failed in with its batch's real counts (a warmup, the recording, a verification replay or its eager
        reference); `skip`: the key is recorded as skipped, with the same reason, and runs eagerly. A sticky
        CUDA error ends the pass under either policy; no partial graph stays registered. `ConfigError` when
        `capture.num_warmups` is below what the backend needs (cuda: 1), when `report.path` cannot be written
        (checked first; written atomically after), or when the KV cache holds fewer blocks than
        `kv_cache.num_blocks`.

        Writes nothing the engine owns but the null block 0 of each KV-cache group, what the model writes for
        pad-slot tokens, `scratch_blocks` (free block ids the engine hands over) and `group_scratch_blocks[name]`
        of each extra group (README: "What capture() writes").
        """
        return self.capturer.capture(scratch_blocks=scratch_blocks, group_scratch_blocks=group_scratch_blocks)

    def capture_pending(
        self,
        max_seconds: float | None = None,
        *,
        max_keys: int | None = None,
        scratch_blocks: Iterable[int] = (),
        group_scratch_blocks: Mapping[str, Iterable[int]] | None = None,
    ) -> int:
        """Capture keys with no graph yet (`capture.strategy: lazy`), most traffic first, while `max_seconds` (None:
        no limit) have not passed and fewer than `max_keys` were taken; returns how many (0: none pending). Each is
        captured and verified as by `capture()`, within the budget, under `capture.on_error`; collective with peers.
        The last step's outputs read the same afterwards (copied aside and back: see `KeptOutputs`).

        `StaticInputMovedError` (naming it, before anything is captured) while a static input differs from what
        the live graphs captured (an object replaced, a storage swapped, a `register_static` name re-registered):
        put back what was captured (or `copy_` new values into it), or `capture()` again to capture every key
        anew. With no graph alive (every key so far failed or was dropped) nothing is refused: the keys are
        captured against the tensors as they are now. Tensors the model reaches that appeared since are recorded
        and checked from then on.

        Fits an engine's idle gap: `max_seconds` counts from this call's first line, a key starts only while time
        is left (the call ends at most one key's capture past it), GC is paused around each key and never
        collected whole; with nothing pending and no peers the call returns at once (`pending()` asks first).
        """
        return self.capturer.capture_pending(
            max_seconds, max_keys=max_keys, scratch_blocks=scratch_blocks, group_scratch_blocks=group_scratch_blocks
        )

    def pending(self) -> list[GraphKey]:
        """The keys `capture_pending()` would capture, in the order it takes them (most traffic first, then
        largest first); empty when there is nothing to capture (`capture.strategy: upfront` after `capture()`,
        or every key captured or skipped). With peers: this rank's keys (`capture_pending` agrees on the order)."""
        return self.capturer.pending()

    def _measure_key(self, key: GraphKey) -> GraphMemory:
        """`key`'s graph memory measured on this model (`Capturer.measure_key`), for the memory budget."""
        return self.capturer.measure_key(key)

    # -- steps ---------------------------------------------------------------------------

    def dispatch(self, batch: StepBatch | None, *, step: int | None = None) -> GraphKey | None:
        """The captured key `batch` would replay with, or None (eager): a query, which runs nothing and counts
        nothing (neither `stats` nor the traffic lazy capture orders keys by). Collective with peers (`step`: see
        `execute`)."""
        batch = step_or_idle(batch)
        with self._scope("dispatch"):  # with a group, a step's collective must not interleave
            mode, key, _ = self._dispatch(batch, step, count=False)
            return None if mode is Mode.EAGER else key

    def execute(self, batch: StepBatch | None, *, step: int | None = None) -> StepOutput:
        """Run one step: dispatch, stage, prepare, check invariants, replay or run eagerly.

        Before every replay the static inputs are checked (`StaticInputMovedError` when one
        moved since capture). Returns what the forward returns (a tensor, or a tuple, list or
        dict of tensors) with each tensor cut to its real rows as `model.output_rows` declares
        (`graphcap.outputs`: per token to `[:batch.num_tokens]`, per request to
        `[:batch.num_reqs]`; undeclared, a tensor with a row per padded token is cut to the real
        tokens): views valid until any graph of the backend's pool replays (the next step), so
        read or clone them first; `capture_pending()` between steps keeps them (`KeptOutputs`),
        `capture()`, `release()`, `resize_kv()` and `reset()` free them. `None` is an idle data-parallel
        rank: it joins the agreed key with no real rows (so does a batch refused with peers, then raises).
        `step`: the engine's step number, which peers must share (default: this manager's count of steps).
        """
        batch = step_or_idle(batch)
        with self._scope.execute:
            peers = self._peers  # with peers: agreed first; a refused batch runs the step idle, then raises
            return self._run(batch, self._dispatch(batch)) if peers is None else peers.execute(batch, self._run, step)

    def _run(self, batch: StepBatch, dispatch: Dispatch) -> StepOutput:
        mode, key, reason = dispatch
        if self._flight is not None:
            self._flight.note(mode, reason)
        if mode is Mode.EAGER:
            output = self._run_eager(batch, key)
            if reason == "not_captured" and not self._warned_not_captured:
                self._warned_not_captured = True  # once per manager: a step run eagerly is no error
                log.warning(NOT_CAPTURED_WARNING)
            if self._counting:  # after the run: a refused batch is no step
                self.stats.eager[reason] += 1
            return output
        self.last_key = key
        sampler = self._sampler  # before the replay: the sampled eager run puts back its writes
        expected = self._sample_eager(sampler, batch, key) if sampler is not None and self._due(sampler) else None
        inputs = self._stage(batch, key, phase="replay")
        graph = self.graphs[key]
        self._guard.check_before_replay()  # what the graph writes: before the launch
        if mode is Mode.PIECEWISE:  # eager ops between pieces read the step through current_inputs()
            with running(inputs):
                output = graph.replay()
        else:  # a full graph runs no Python: skip the context (about 1 us per step)
            output = graph.replay()
        self._guard.check_after_replay()  # the weights it reads: while the launch runs, before returning
        if self._counting:
            stats = self.stats
            stats.graph_hits[key] += 1
            stats.real_tokens += batch.num_tokens
            stats.padded_tokens += key.num_tokens
            if mode is Mode.PIECEWISE:
                pieces = cast(PiecewiseGraph, graph)  # a piecewise key's graph
                stats.eager_op_calls += len(pieces.calls)
                stats.eager_op_copies += pieces.copies_per_replay
        output = self._outputs.real(output, inputs)
        if expected is not None and sampler is not None:
            sampler.compare(key, output, expected, self.config.checks.tolerance, precision_of(self.model))
        self._kept.hold(graph, output)
        return output

    def _due(self, sampler: StepSampler) -> bool:
        """Whether this replay is sampled; with peers, decided once per agreed step (`StepAgreement.sampled`)."""
        return sampler.due() if self._peers is None else self._peers.sampled(sampler.due)

    def _sample_eager(self, sampler: StepSampler, batch: StepBatch, key: GraphKey) -> Expected:
        """The eager run of a sampled step (`checks.sample_every`), its KV writes put back (`graphcap.checks.sampling`).

        Unpadded as `eager()` runs, at the step's own key-axis values; with peers at the replayed key's shape (every
        rank runs it in the same step)."""
        registry = self.registry
        axes = registry.axis_values(batch.axes)
        eager_key = key if self._peers is not None else registry.eager_key(batch.num_tokens, batch.num_reqs, axes)
        kv = self.config.kv_cache
        caches: list[tuple[str | None, int, int]] = [(None, kv.block_size, kv.num_blocks)]
        caches += [(g.name, g.block_size, g.num_blocks) for g in self.buffers.limits.kv_groups]
        with in_phase("eager"):
            inputs = self._stage(batch, eager_key, phase="eager")
            found = locate(self._guard.collect(self.model, {}), caches)
            return sampler.eager(inputs, self._forward, lambda out: self._outputs.real(out, inputs), found)

    def eager(self, batch: StepBatch) -> StepOutput:
        """The reference: the model on the same staging path, unpadded, with no graph."""
        batch = step_or_idle(batch)
        with self._scope("eager"):
            return self._run_eager(batch)

    def _run_eager(self, batch: StepBatch, key: GraphKey | None = None) -> StepOutput:  # key: unpadded, or pad_eager's
        key = key or self.registry.eager_key(batch.num_tokens, batch.num_reqs, self.registry.axis_values(batch.axes))
        self.last_key = key
        self._kept.drop()  # a step: the last replay's outputs are no longer valid
        with in_phase("eager"):
            inputs = self._stage(batch, key, phase="eager")
            with torch.inference_mode(), running(inputs):
                output = self._forward(inputs)
        return self._outputs.real(output, inputs, what="model.forward (eager) of")

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
        if dummy:  # a batch graphcap made (capture, verification): an earlier forward may have broken a view
            buffers.layout.restore_views((key.num_tokens, batch.num_reqs if key.num_reqs is None else key.num_reqs))
        if not kv_writes:
            buffers.silence_kv_writes(inputs)
        if self._peers is not None:
            self._peers.write_counts(inputs)
        if self._prepare is not None:
            self._prepare(inputs, phase)
        try:
            check_invariants(inputs, self._level, dummy=dummy or batch.block_table is None, kv_writes=kv_writes)
        except InvariantViolation:
            buffers.forget_padding()  # something other than staging wrote the rows
            raise
        if self._flight is not None:
            self._flight.record(inputs, dummy or batch.block_table is None, kv_writes)
        buffers.upload()  # the rows just staged and checked
        if self._peers is not None:  # a step's: its TP peers' rows passed too (a refusal makes every rank idle)
            self._peers.staged()
        return inputs

    def _dispatch(self, batch: StepBatch, step: int | None = None, *, count: bool = True) -> Dispatch:
        if self._peers is not None:
            return self._peers.plan(batch, "dispatch", step).dispatch
        registry = self.registry
        uniform = batch.is_uniform(registry.uniform_query_len)
        return registry.dispatch(batch.num_tokens, batch.num_reqs, uniform, batch.axes, count=count)

    # -- bookkeeping ---------------------------------------------------------------------

    def register_static(self, name: str, tensor: torch.Tensor) -> None:
        """Add a tensor the graphs read that is not a parameter or buffer of an `nn.Module` model (a KV cache
        in a plain list, an engine buffer): address-checked like parameters at capture and before every replay,
        named `static.NAME` in errors. Register before `capture()`; a tensor re-registered at another address
        or whose storage was replaced makes replays raise `StaticInputMovedError` until `capture()` again."""
        with self._scope.lock:
            self._guard.register(name, tensor)

    def reset(self) -> None:
        """Release every graph; later steps run eagerly until `capture()` runs again. Collective with peers."""
        with self._scope("reset"):
            self._agree_call("reset")
            self._history.freed("reset()", self._live.release_all())

    def release(self) -> int:
        """Free every graph and its pool memory (an engine going to sleep); returns how many.

        Keeps the buffers, block table rows and registrations: `capture()` (or, lazy, `capture_pending()`)
        serves again on the same addresses; steps between run eagerly (reason `released`). On CUDA the memory
        goes back to the device and later captures use a fresh pool (never one whose graphs were freed).
        Collective with peers (every rank releases, or every rank raises)."""
        with self._scope("release"):
            self._agree_call("release")
            count = self._live.release_all("released")
            self.backend.empty_cache()
            return self._history.freed("release()", count, self.stats)

    def resize_kv(self, num_blocks: int, tensors: Any = None, *, group: str | None = None, block_dim: int = 0) -> int:
        """The engine re-allocated its KV cache (of `group`; None: `kv_cache`) to `num_blocks` blocks.

        Releases every graph (steps run eagerly, reason `kv_resized`, until `capture()`/`capture_pending()`);
        later steps and captures use the new bound. `tensors`: the new cache tensors (a tensor, list or mapping),
        dim `block_dim` counting blocks, checked and registered like `register_static`. Refusals change nothing:
        `ConfigError` naming the key for a count the config refuses or a cache that holds fewer blocks;
        `BatchError` naming a block table row holding a block past the bound. Returns the graphs released.
        Collective with peers: a refusal on any rank changes nothing on every rank."""
        with self._scope("resize_kv"):
            try:
                config, named = resize_plan(self.config, self.model, num_blocks, tensors, group, block_dim)
                for name, tensor in named.items():  # what register() would refuse, before anything changes
                    self._guard.check_registrable(name, tensor)
                table = self.buffers.block_table if group is None else self.buffers.kv_groups.tables[group]
                table.check_resize(num_blocks)
            except Exception as exc:
                if self._peers is None:
                    raise
                self._agree_call("resize_kv", exc, f"{group}:{num_blocks}")
                raise
            self._agree_call("resize_kv", None, f"{group}:{num_blocks}")
            self.buffers.resize_kv(num_blocks, group)
            self.config = config
            released = self._live.release_all("kv_resized")
            for name, tensor in named.items():
                self._guard.register(name, tensor)
            return self._history.freed("resize_kv()", released, self.stats)

    def _agree_call(self, kind: str, refused: BaseException | None = None, detail: str = "") -> None:
        """With peers: agree `kind` (release, resize_kv, reset) before it changes any graph (`agree_call`)."""
        if self._peers is not None:
            self._peers.current = None
            self._peers.agree_call(kind, refused, detail)

    def __repr__(self) -> str:
        return f"CaptureManager({len(self.graphs)} graphs, backend={self.backend.name}, device={self.device})"
