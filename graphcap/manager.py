"""`CaptureManager`: capture every planned key, then dispatch, stage, check and replay each step.

Capture walks the keys largest first. For each key a dummy batch goes through the same
`PersistentBuffers.stage` as real steps, its invariants are checked, the model runs
`num_warmups` times eagerly, the backend captures, and (with `checks.verify_replay`) one
replay is compared with an eager run on the same inputs. A pass is all or nothing under
`capture.on_error: raise`; under `skip` a failing key is recorded and runs eagerly.
"""

from __future__ import annotations

import gc
import inspect
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from graphcap._extras import sampled
from graphcap.backends import CapturedGraph, GraphBackend, get_backend, is_sticky_cuda_error, resolve_device
from graphcap.backends.pieces import forbidden_reads
from graphcap.batch import GraphKey, StepBatch, dummy_batch
from graphcap.block_table import BlockTable
from graphcap.buffers import ForwardInputs, PersistentBuffers
from graphcap.config import CaptureConfig
from graphcap.config.fingerprint import compared_items, fingerprint_int
from graphcap.dispatch import KeyRegistry, StepStats
from graphcap.distributed import DataParallelSync
from graphcap.errors import CaptureError, CaptureUnsafeError, ConfigError, ConfigProblem
from graphcap.guard import StaticGuard
from graphcap.inputs import BufferSpec
from graphcap.invariants import check_invariants
from graphcap.piecewise import running
from graphcap.report import CaptureReport, GraphRecord, check_report_path, format_bytes
from graphcap.verification import real_rows, verify_probe, verify_replay

__all__ = ["CaptureManager"]

log = logging.getLogger("graphcap")

_OOM_HINT = (
    "the GPU ran out of memory while capturing; capture fewer sizes (capture.sizes), "
    "lower capture.max_size, or set capture.on_error: skip to run this size eagerly"
)
_STICKY_HINT = (
    "this CUDA error is sticky: the CUDA context of this process is unusable (every later kernel, eager "
    "ones too, fails with it), so the pass stops here; restart the process. CUDA reports kernel errors "
    "late, so the faulty kernel may belong to an earlier key or step: rerun with CUDA_LAUNCH_BLOCKING=1 "
    "to locate it; a device-side assert in an indexing kernel usually means out-of-range metadata "
    "(run with checks.invariants: full)"
)


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
    ) -> None:
        if not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must have a callable forward(inputs); got {type(model).__name__}")
        if capture_context is not None and not callable(capture_context):
            raise TypeError(
                "capture_context must be a callable returning a context manager (e.g. a "
                f"@contextlib.contextmanager function); got {type(capture_context).__name__}"
            )
        self._capture_context = capture_context or nullcontext
        """Entered around every capture pass (e.g. an engine's `graph_capture()` that sets up
        custom all-reduce buffers for tensor parallelism, as vLLM's does)."""
        self.model = model
        self.config = config
        self.device = resolve_device(config)
        self.buffers = PersistentBuffers.from_config(config, self.device, extras=_buffer_specs(config, buffers))
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
        self._forward: Callable[[ForwardInputs], torch.Tensor] = model.forward
        self._prepare = getattr(model, "prepare", None)
        # `prepare(inputs, capturing)`, or `prepare(inputs, capturing, *, replay)` when it asks to
        # learn whether the staging feeds a graph replay or an eager run.
        self._prepare_replay = self._prepare is not None and _accepts(self._prepare, "replay")
        self._lock = threading.RLock()
        self._sync = DataParallelSync(group, timeout=dp_timeout) if group is not None else None
        if self._sync is not None:  # ranks with different configs would plan different keys: refuse now
            self._sync.agree_on_config(fingerprint_int(config), compared_items(config))
        self._counting = True
        self._in_step: str | None = None
        self._guard = StaticGuard()
        self._scratch_blocks: tuple[int, ...] = ()  # KV blocks the current capture pass may write
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
        """Capture every planned key (largest first) and return the report.

        What the pass writes: the persistent buffers (graphcap's own staging), the null block 0
        of the KV cache (dummy batches keep their keys and values there), whatever the model
        writes for padded tokens (the pad slot: for the built-in model its own scratch block),
        and the blocks of `scratch_blocks`. Nothing else the engine owns: a re-capture while
        requests are in flight leaves their KV blocks bit-identical. `scratch_blocks` are block
        ids the engine is not using (from its free list): the verification batch then writes its
        keys and values there, one slot per token; without enough of them it reads live blocks
        and writes no KV slot.

        Replaces graphs from an earlier pass. `capture.on_error: raise`: the first failure
        releases every graph of this pass and raises `CaptureError` naming the key and a
        hint. `skip`: the key is recorded as skipped and runs eagerly. A sticky CUDA error
        (a device-side assert) ends the pass under either policy: nothing after it can run.
        A failed key's tensors are freed before the next key runs. On every exit path GC is
        unfrozen and re-enabled and no partial graph stays registered. Raises `ConfigError`
        when `capture.num_warmups` is below what the backend needs (cuda: 1).

        With `report.path`, the path is checked before anything is captured (`ConfigError`
        when it cannot be written) and the report is written atomically after the pass; if
        that write still fails, the pass is undone like any other failure (graphs released,
        `CaptureError` naming the path and the reason; the old report stays whole).
        """
        report_path = self.config.report.path
        if report_path:
            check_report_path(report_path)
        scratch = self._check_scratch(scratch_blocks)
        with self._lock, self._step("capture"):
            self._check_warmups()
            self._scratch_blocks = scratch
            self._release_all()
            self._guard.arm(self._guard.collect(self.model, self.buffers.storage()), self.model)
            order = self.registry.capture_order()
            records: list[GraphRecord] = []
            start = time.perf_counter()
            try:
                with self._capture_context(), _gc_frozen(), logging_redirect_tqdm(), self.buffers.table_set_aside():
                    self.backend.empty_cache()  # once per pass (S4); the graphs then share the pool
                    memory_before = self.backend.memory_in_use()
                    bar = tqdm(
                        order,
                        desc="capture",
                        unit="graph",
                        file=sys.stderr,
                        disable=None if self.progress is None else not self.progress,
                        leave=False,
                    )
                    with bar:
                        for key in bar:
                            bar.set_postfix_str(self._progress_note(key), refresh=False)
                            records.append(self._capture_key(key))
            except BaseException:
                self._release_all()
                raise
            report = CaptureReport(
                records=records,
                backend=self.backend.name,
                device=str(self.device),
                total_seconds=time.perf_counter() - start,
                pool_bytes=max(0, self.backend.memory_in_use() - memory_before),
                config=self.config.to_dict(),
                warnings=self._pass_warnings(),
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

    def _capture_key(self, key: GraphKey) -> GraphRecord:
        start = time.perf_counter()
        eager_seconds = 0.0
        graph = None
        failure: BaseException | None = None
        try:
            batch = self._sampled(dummy_batch(self._shape_of(key), max_model_len=self.config.kv_cache.max_model_len), 0)
            inputs = self._stage(batch, self.registry.staging_key(key, batch.num_reqs), capturing=True, dummy=True)
            forward = self._forward
            # A full graph holds the whole forward (eager ops run their capturable stand-ins);
            # a piecewise key's reference is the plain eager forward.
            phase = "eager" if key.piecewise else "full"

            def run() -> Any:
                with running(inputs, phase):
                    return forward(inputs)

            t0 = time.perf_counter()
            warmup = self._piecewise_warmup(inputs) if key.piecewise else run
            self.backend.warmup(warmup, self.config.capture.num_warmups)
            self.backend.synchronize()  # time the warmups' GPU work, not their launches
            eager_seconds += time.perf_counter() - t0
            if key.piecewise:

                def run_pieces(session: Any) -> Any:
                    with running(inputs, "piecewise", session):
                        return forward(inputs)

                graph = self.backend.capture_pieces(run_pieces, self._static_inputs(inputs), name=str(key))
            else:
                graph = self.backend.capture(run, self._static_inputs(inputs), name=str(key))
            verified = False
            if self.config.checks.verify_replay:
                eager_seconds += self._verify(graph, run, inputs)
                eager_seconds += self._verify_probe(graph, key)
                verified = True
        except (KeyboardInterrupt, SystemExit):
            if graph is not None:
                graph.release()
            raise
        except Exception as exc:  # any failure of one key is handled the same way below
            failure = exc
        failure = self._agree_on_failure(key, failure)
        sticky = failure is not None and is_sticky_cuda_error(failure)
        if self._sync is not None:  # a rank that stops must not leave its peers waiting in the next key
            sticky_rank = self._sync.first_failed_rank(sticky, what=f"capture of {key}: sticky CUDA error")
            if sticky_rank is not None and not sticky:
                failure = CaptureError(
                    f"rank {sticky_rank} hit a sticky CUDA error (its own error names it); every rank stops the pass"
                )
                sticky = True
        if failure is not None:
            if graph is not None:
                graph.release()
            reason = _describe_failure(failure)
            _drop_frames(failure)  # C1: the failed forward's tensors must not outlive this key
            if sticky:
                raise CaptureError(f"capturing {key} failed: {reason}; {_STICKY_HINT}") from failure
            if self.config.capture.on_error == "raise":
                if isinstance(failure, CaptureUnsafeError):
                    # Keep the type engines catch; the message already names op and line.
                    failure.args = (f"capturing {key} failed: {failure}",)
                    raise failure
                raise CaptureError(f"capturing {key} failed: {reason}") from failure
            log.warning("skipping %s: %s", key, reason)
            self.registry.mark_skipped(key, reason)
            return GraphRecord(key, "skipped", time.perf_counter() - start, 0, False, reason, eager_seconds)
        self.graphs[key] = graph
        self.registry.mark_captured(key)
        return GraphRecord(
            key,
            "captured",
            time.perf_counter() - start,
            graph.memory_bytes,
            verified,
            "",
            eager_seconds,
            pieces=getattr(graph, "num_pieces", 1),
            eager_ops=len(getattr(graph, "calls", ())),
        )

    _verify = verify_replay
    _verify_probe = verify_probe

    def _shape_of(self, key: GraphKey) -> GraphKey:
        return key.shape(self.config.batching.max_num_seqs)

    def _sampled(self, batch: StepBatch, seed: int) -> StepBatch:
        """`batch` with real rows for every engine buffer that has a `sample` (capture and verification)."""
        specs = self.buffers.extras
        if not any(spec.sample is not None for spec in specs):
            return batch
        rng = np.random.default_rng([seed, batch.num_tokens, batch.num_reqs])
        extras = sampled(specs, rng, batch.num_tokens, batch.num_reqs)
        return StepBatch(batch.query_lens, batch.seq_lens, batch.input_ids, batch.block_table, extras=extras)

    def _piecewise_warmup(self, inputs: ForwardInputs) -> Callable[[], Any]:
        """The warmup of a piecewise key: eager ops run outside the checks (their bodies never run
        in a graph), and the code between them may not read request metadata (`forbidden_reads`)."""
        forward = self._forward

        def run() -> Any:
            with running(inputs, "piecewise_warmup"), forbidden_reads(inputs):
                return forward(inputs)

        return run

    def _check_scratch(self, blocks: Iterable[int]) -> tuple[int, ...]:
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
            raise TypeError(f"scratch_blocks must be a list of block ids; got {type(blocks).__name__}")
        out = []
        num_blocks = self.config.kv_cache.num_blocks
        for block in blocks:
            if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 1 <= block < num_blocks:
                raise ValueError(
                    f"scratch_blocks holds {block!r}; scratch blocks are ids of free KV-cache blocks in "
                    f"[1, {num_blocks}) (kv_cache.num_blocks; block 0 is the null block, written anyway)"
                )
            out.append(int(block))
        return tuple(out)

    def _check_warmups(self) -> None:
        """R4: a backend that needs plain warmups before capture (cuda) refuses `num_warmups: 0`."""
        need, have = self.backend.min_warmups, self.config.capture.num_warmups
        if have < need:
            message = (
                f"{have} is too few for the {self.backend.name} backend: it needs at least {need} eager run "
                "before each capture, so that lazy initialisation (cuBLAS workspaces, Triton autotuning, "
                f"torch.compile, NCCL communicators) happens outside the graph; set it to {need} or more"
            )
            raise ConfigError([ConfigProblem("capture.num_warmups", message)])

    def _pass_warnings(self) -> list[str]:
        """What the report must say about this pass beyond its records (compiled code captured uncompiled)."""
        uncompiled = sorted({f for graph in self.graphs.values() for f in graph.uncompiled})
        if not uncompiled:
            return []
        return [
            f"torch.compile was off while the {self.backend.name} backend captured: {', '.join(uncompiled)} "
            "ran uncompiled in the graphs (eager steps run them compiled)"
        ]

    def _agree_on_failure(self, key: GraphKey, failure: BaseException | None) -> BaseException | None:
        if self._sync is None:
            return failure
        failed_rank = self._sync.first_failed_rank(failure is not None, what=f"capture of {key}")
        if failure is None and failed_rank is not None:
            # Capture is in lockstep: a key one rank lacks is dropped by every rank (or raises).
            return CaptureError(f"rank {failed_rank} failed to capture it; data-parallel ranks keep the same keys")
        return failure

    # -- steps ---------------------------------------------------------------------------

    def dispatch(self, batch: StepBatch | None) -> GraphKey | None:
        """The captured key `batch` replays with, or None (eager). Collective with a group."""
        with self._lock, self._step("dispatch"):  # with a group, a step's collective must not interleave
            return self._dispatch(_or_empty(batch))[0]

    def execute(self, batch: StepBatch | None) -> Any:
        """Run one step: dispatch, stage, prepare, check invariants, replay or run eagerly.

        Before every replay the static inputs are checked (`StaticInputMovedError` when one
        moved since capture). Returns what the forward returns (a tensor, or a tuple, list or
        dict of tensors) with every tensor whose leading dim is the padded token count cut to
        the real rows `[:batch.num_tokens]`: views valid until any graph of the backend's pool
        replays (the next step), so read or clone them first. `None` is an idle data-parallel
        rank: it joins the agreed key with no real rows.
        """
        batch = _or_empty(batch)
        with self._lock, self._step("execute"):
            key, reason = self._dispatch(batch)
            if key is None:
                output = self._run_eager(batch)
                if self._counting:  # after the run: a refused batch is no step
                    self.stats.eager[reason] += 1
                return output
            self.last_key = key
            piecewise = key.piecewise
            inputs = self._stage(batch, self.registry.staging_key(key, batch.num_reqs) if piecewise else key)
            graph = self.graphs[key]
            self._guard.check(sweep=self._level != "off")
            if piecewise:  # eager ops between pieces read the step through current_inputs()
                with running(inputs):
                    output = graph.replay()
            else:  # a full graph runs no Python: skip the context (about 1 us per step)
                output = graph.replay()
            if self._counting:
                stats = self.stats
                stats.graph_hits[key] += 1
                stats.real_tokens += batch.num_tokens
                stats.padded_tokens += key.num_tokens
                if piecewise:
                    stats.eager_op_calls += len(graph.calls)
                    stats.eager_op_copies += graph.copies_per_replay
            return real_rows(output, batch.num_tokens, key.num_tokens)

    def eager(self, batch: StepBatch) -> Any:
        """The reference: the model on the same staging path, unpadded, with no graph."""
        batch = _or_empty(batch)
        with self._lock, self._step("eager"):
            return self._run_eager(batch)

    def _run_eager(self, batch: StepBatch) -> torch.Tensor:
        key = self.registry.eager_key(batch.num_tokens, batch.num_reqs)
        self.last_key = key
        inputs = self._stage(batch, key, replay=False)
        with torch.inference_mode(), running(inputs):
            output = self._forward(inputs)
        return real_rows(output, batch.num_tokens, batch.num_tokens, what="model.forward (eager) of")

    def _stage(
        self,
        batch: StepBatch,
        key: GraphKey,
        *,
        capturing: bool = False,
        dummy: bool = False,
        replay: bool = True,
        kv_writes: bool = True,
    ) -> ForwardInputs:
        """The one staging path of capture, replay and eager: stage, let the model plan, prove, upload.

        The invariants run after `prepare`, on the host rows the upload then copies, so nothing
        `prepare` writes reaches a graph unchecked. `dummy`: a batch graphcap made (its requests
        share the null block by design). `replay`: the staging feeds a graph (capture, replay),
        not an eager run. `kv_writes=False`: a verification batch that reads live blocks; its real
        tokens get the pad slot, so the forward writes no KV slot an engine's request may own.
        """
        inputs = self.buffers.stage(batch, key, upload=False)
        if not kv_writes:
            inputs.host.slot_mapping[: inputs.num_tokens] = self.buffers.limits.pad.slot
        if self._prepare_replay:
            self._prepare(inputs, capturing=capturing, replay=replay)
        elif self._prepare is not None:
            self._prepare(inputs, capturing=capturing)
        check_invariants(inputs, self._level, dummy=dummy or batch.block_table is None, kv_writes=kv_writes)
        self.buffers.upload()  # the rows just staged and checked
        return inputs

    def _dispatch(self, batch: StepBatch) -> tuple[GraphKey | None, str]:
        registry = self.registry
        uniform = batch.is_uniform(registry.uniform_query_len)
        key, reason = registry.dispatch(batch.num_tokens, batch.num_reqs, uniform)
        if self._sync is None:
            return key, reason
        # Data-parallel agreement: every rank dispatches on the same reduced counts, so all
        # replay one key or all run eagerly. An idle rank (no requests) joins any key.
        cannot = key is None and not (batch.num_reqs == 0 and registry.mode != "none")
        num_tokens, any_cannot, any_mixed, num_reqs = self._sync.reduce_max(
            [batch.num_tokens, int(cannot), int(not uniform), batch.num_reqs], "dispatch"
        )
        own_reason = reason if key is None else "peer"
        if any_cannot:
            return None, own_reason
        agreed, _ = registry.dispatch(num_tokens, num_reqs, not any_mixed)
        return (agreed, "") if agreed is not None else (None, own_reason)

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
            yield
        finally:
            self._in_step = None

    def _progress_note(self, key: GraphKey) -> str:
        free = self.backend.free_memory()
        return str(key) if free is None else f"{key} free {format_bytes(free)}"

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


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """Collect, freeze and disable GC for the capture pass; restore on every exit path.

    A collection in the middle of a capture can free tensors the graph still records;
    freezing also keeps the long-lived objects out of later collections' work.
    """
    was_enabled = gc.isenabled()
    was_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if not was_frozen:
            gc.unfreeze()
        if was_enabled:
            gc.enable()
        gc.collect()


def _buffer_specs(config: CaptureConfig, buffers: Iterable[BufferSpec]) -> tuple[BufferSpec, ...]:
    """The engine buffers: those of the config's `buffers:` list, then those passed in."""
    if isinstance(buffers, BufferSpec) or not isinstance(buffers, Iterable):
        raise TypeError(f"buffers must be a list of graphcap.BufferSpec; got {type(buffers).__name__}")
    return (*config.buffer_specs(), *buffers)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: keep the two-argument call
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _describe_failure(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]  # an exception may have no message
    # An OOM inside cudaGraphInstantiate surfaces as "CUDA error: out of memory", not OutOfMemoryError.
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA error: out of memory" in text:
        return f"out of memory ({text[:160] or 'no message'}); {_OOM_HINT}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _drop_frames(exc: BaseException) -> None:
    """Free what the frames of a failed capture hold (its tensors live in the graph pool).

    The failure kept in `_capture_key` references its traceback, whose frames reference the
    failure again (a cycle) and every tensor of the failed forward; GC is off for the pass,
    so without this they would pin the pool until the pass ends (C1). Frames keep their
    file and line for the traceback; only their locals go. `gc.collect()` then frees any
    other cycle the forward left (cheap: the heap is frozen).
    """
    pending, seen = [exc], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]
    gc.collect()


_EMPTY = StepBatch([], [])


def _or_empty(batch: StepBatch | None) -> StepBatch:
    if batch is None:
        return _EMPTY
    if not isinstance(batch, StepBatch):
        raise TypeError(f"expected a StepBatch (or None for an idle rank); got {type(batch).__name__}")
    return batch
