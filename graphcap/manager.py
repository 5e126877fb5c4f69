"""`CaptureManager`: capture every planned key, then dispatch, stage, check and replay each step.

Capture walks the keys largest first. For each key a dummy batch goes through the same
`PersistentBuffers.stage` as real steps, its invariants are checked, the model runs
`num_warmups` times eagerly, the backend captures, and (with `checks.verify_replay`) one
replay is compared with an eager run on the same inputs. A pass is all or nothing under
`capture.on_error: raise`; under `skip` a failing key is recorded and runs eagerly.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from graphcap.backends import CapturedGraph, GraphBackend, get_backend, resolve_device
from graphcap.batch import GraphKey, StepBatch, dummy_batch
from graphcap.buffers import ForwardInputs, PersistentBuffers
from graphcap.config import CaptureConfig
from graphcap.config.fingerprint import compared_items, fingerprint_int
from graphcap.dispatch import KeyRegistry, StepStats
from graphcap.distributed import DataParallelSync
from graphcap.errors import CaptureError, CaptureUnsafeError
from graphcap.invariants import check_invariants
from graphcap.report import CaptureReport, GraphRecord, check_report_path, format_bytes

__all__ = ["CaptureManager"]

log = logging.getLogger("graphcap")

_OOM_HINT = (
    "the GPU ran out of memory while capturing; capture fewer sizes (capture.sizes), "
    "lower capture.max_size, or set capture.on_error: skip to run this size eagerly"
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
    ) -> None:
        if not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must have a callable forward(inputs); got {type(model).__name__}")
        self.model = model
        self.config = config
        self.device = resolve_device(config)
        self.buffers = PersistentBuffers.from_config(config, self.device)
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
        self._lock = threading.RLock()
        self._sync = DataParallelSync(group, timeout=dp_timeout) if group is not None else None
        if self._sync is not None:  # ranks with different configs would plan different keys: refuse now
            self._sync.agree_on_config(fingerprint_int(config), compared_items(config))
        self._counting = True
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
    def lock(self) -> threading.RLock:
        """The re-entrant lock every step and capture holds.

        Hold it around `execute` and the use of its result when several threads share the
        manager: another thread's next step overwrites the returned view.
        """
        return self._lock

    # -- capture -------------------------------------------------------------------------

    def capture(self) -> CaptureReport:
        """Capture every planned key (largest first) and return the report.

        Replaces graphs from an earlier pass. `capture.on_error: raise`: the first failure
        releases every graph of this pass and raises `CaptureError` naming the key and a
        hint. `skip`: the key is recorded as skipped and runs eagerly. On every exit path GC
        is unfrozen and re-enabled and no partial graph stays registered.

        With `report.path`, the path is checked before anything is captured (`ConfigError`
        when it cannot be written) and the report is written atomically after the pass; if
        that write still fails, the pass is undone like any other failure (graphs released,
        `CaptureError` naming the path and the reason; the old report stays whole).
        """
        report_path = self.config.report.path
        if report_path:
            check_report_path(report_path)
        with self._lock:
            self._release_all()
            order = self.registry.capture_order()
            records: list[GraphRecord] = []
            start = time.perf_counter()
            memory_before = self.backend.memory_in_use()
            try:
                with _gc_frozen(), logging_redirect_tqdm():
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
            batch = dummy_batch(key, max_model_len=self.config.kv_cache.max_model_len)
            inputs = self._stage(batch, key, capturing=True)
            forward = self._forward

            def run() -> torch.Tensor:
                return forward(inputs)

            t0 = time.perf_counter()
            self.backend.warmup(run, self.config.capture.num_warmups)
            eager_seconds += time.perf_counter() - t0
            graph = self.backend.capture(run, self._static_inputs(inputs), name=str(key))
            verified = False
            if self.config.checks.verify_replay:
                eager_seconds += self._verify(graph, run, inputs)
                verified = True
        except (KeyboardInterrupt, SystemExit):
            if graph is not None:
                graph.release()
            raise
        except Exception as exc:  # any failure of one key is handled the same way below
            failure = exc
        failure = self._agree_on_failure(key, failure)
        if failure is not None:
            if graph is not None:
                graph.release()
            reason = _describe_failure(failure)
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
            key, "captured", time.perf_counter() - start, graph.memory_bytes, verified, "", eager_seconds
        )

    def _verify(self, graph: CapturedGraph, run: Callable[[], torch.Tensor], inputs: ForwardInputs) -> float:
        """Replay once and compare with an eager run on the same staged inputs."""
        graph.check_addresses(self._static_inputs(inputs))
        replayed = graph.replay()[: inputs.num_tokens].clone()
        t0 = time.perf_counter()
        with torch.inference_mode():
            expected = run()[: inputs.num_tokens]
        seconds = time.perf_counter() - t0
        try:
            torch.testing.assert_close(replayed, expected, **self.config.checks.tolerance)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()
            raise CaptureError(
                f"replay differs from eager on the same inputs ({'; '.join(first[:3])}); the forward "
                "depends on something the graph froze (a Python value, a host tensor, randomness)"
            ) from None
        return seconds

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
        with self._lock:  # with a group, a step's collective must not interleave with another's
            return self._dispatch(_or_empty(batch))[0]

    def execute(self, batch: StepBatch | None) -> torch.Tensor:
        """Run one step: dispatch, stage, check invariants, prepare, replay or run eagerly.

        Returns the real rows `[:batch.num_tokens]` (a view valid until the next step).
        `None` is an idle data-parallel rank: it joins the agreed key with no real rows.
        """
        batch = _or_empty(batch)
        with self._lock:
            key, reason = self._dispatch(batch)
            if key is None:
                output = self._run_eager(batch)
                if self._counting:  # after the run: a refused batch is no step
                    self.stats.eager[reason] += 1
                return output
            self.last_key = key
            inputs = self._stage(batch, key)
            graph = self.graphs[key]
            if graph.num_replays == 0 or self._level == "full":
                graph.check_addresses(self._static_inputs(inputs))
            output = graph.replay()
            if self._counting:
                stats = self.stats
                stats.graph_hits[key] += 1
                stats.real_tokens += batch.num_tokens
                stats.padded_tokens += key.num_tokens
            return output[: batch.num_tokens]

    def eager(self, batch: StepBatch) -> torch.Tensor:
        """The reference: the model on the same staging path, unpadded, with no graph."""
        batch = _or_empty(batch)
        with self._lock:
            return self._run_eager(batch)

    def _run_eager(self, batch: StepBatch) -> torch.Tensor:
        key = self.registry.eager_key(batch.num_tokens, batch.num_reqs)
        self.last_key = key
        inputs = self._stage(batch, key)
        with torch.inference_mode():
            return self._forward(inputs)[: batch.num_tokens]

    def _stage(self, batch: StepBatch, key: GraphKey, *, capturing: bool = False) -> ForwardInputs:
        """The one staging path of capture, replay and eager: stage, prove, let the model plan."""
        inputs = self.buffers.stage(batch, key)
        check_invariants(inputs, self._level)
        if self._prepare is not None:
            self._prepare(inputs, capturing=capturing)
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

    def _static_inputs(self, inputs: ForwardInputs) -> dict[str, torch.Tensor]:
        tensors = inputs.tensors()
        if isinstance(self.model, torch.nn.Module):
            tensors.update({f"model.{n}": t for n, t in self.model.named_parameters()})
            tensors.update({f"model.{n}": t for n, t in self.model.named_buffers()})
        return tensors

    def _progress_note(self, key: GraphKey) -> str:
        free = self.backend.free_memory()
        return str(key) if free is None else f"{key} free {format_bytes(free)}"

    def _release_all(self) -> None:
        """Drop every graph of this manager and, when the backend is ours, its memory pool."""
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self.registry.reset()
        if self._owns_backend:
            self.backend.reset()

    def reset(self) -> None:
        """Release every graph; later steps run eagerly until `capture()` runs again."""
        with self._lock:
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


def _describe_failure(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]  # an exception may have no message
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory ({text[:160] or 'no message'}); {_OOM_HINT}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_EMPTY = StepBatch([], [])


def _or_empty(batch: StepBatch | None) -> StepBatch:
    if batch is None:
        return _EMPTY
    if not isinstance(batch, StepBatch):
        raise TypeError(f"expected a StepBatch (or None for an idle rank); got {type(batch).__name__}")
    return batch
