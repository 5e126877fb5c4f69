"""`CaptureCalls`: the capture half of `CaptureManager`: `capture()`, `capture_pending()`, `pending()`.

A mixin of the manager, in its own room so each half reads on its own: it builds a capture pass
(`CapturePass`) from the manager's buffers, registry, guard and policies, and hands it to
`run_pass` (`graphcap.capture.driver`). It holds no state of its own; every attribute it reads is
the manager's (set in `CaptureManager.__init__`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from graphcap.backends.sync_debug import beside_engine_threads
from graphcap.capture.driver import run_pass
from graphcap.capture.lazy import check_time_limits
from graphcap.capture.lifecycle import check_kv_fits
from graphcap.capture.runner import CapturePass, uncompiled_warnings
from graphcap.communicators import key_captured_hook
from graphcap.config.byte_counts import format_bytes
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.keys import GraphKey
from graphcap.memory.estimate import GraphMemory
from graphcap.memory.measured import measure_graph
from graphcap.model_facts import precision_of
from graphcap.probe import check_scratch_free, group_scratch_ids, scratch_block_ids
from graphcap.report import CaptureReport, write_report
from graphcap.report_files import check_report_path

__all__ = ["CaptureCalls"]

log = logging.getLogger("graphcap")


class CaptureCalls:
    """`capture()`, `capture_pending()` and `pending()` of `CaptureManager` (see its docstring)."""

    def capture(
        self, *, scratch_blocks: Iterable[int] = (), group_scratch_blocks: Mapping[str, Iterable[int]] | None = None
    ) -> CaptureReport:
        """Capture every planned key (largest first), verify each, and return the report.

        Replaces graphs from an earlier pass; under `capture.strategy: lazy` captures nothing (the report
        lists the pending keys; `capture_pending` captures them). `capture.on_error: raise`: the first
        failure releases every graph of this pass and raises `CaptureError` naming the key and a hint;
        `skip`: the key is recorded as skipped and runs eagerly. A sticky CUDA error ends the pass under
        either policy; no partial graph stays registered. `ConfigError` when `capture.num_warmups` is
        below what the backend needs (cuda: 1), when `report.path` cannot be written (checked first;
        written atomically after), or when the KV cache holds fewer blocks than `kv_cache.num_blocks`.

        Writes nothing the engine owns but the null block 0 of each KV-cache group, what the model writes for
        pad-slot tokens, `scratch_blocks` (free block ids the engine hands over) and `group_scratch_blocks[name]`
        of each extra group (README: "What capture() writes").
        """
        report_path = self.config.report.path

        def checked() -> CapturePass:  # the refusals, before anything is written
            if report_path:
                check_report_path(report_path)
            return self._capture_pass(scratch_blocks, group_scratch_blocks)  # checks the scratch blocks first

        with self._scope("capture"):
            # Built under the lock: a resize_kv() waiting for it would otherwise leave the pass the old KV bound.
            job = self._check_ready("capture", checked)
            replaced = len(self.graphs)
            self._live.release_all("pending" if self._lazy.is_lazy else "not_captured")
            keys = [] if self._lazy.is_lazy else self.registry.capture_order()  # lazy: capture_pending() later
            start = time.perf_counter()
            try:
                records, pool_bytes = self._capture_keys(job, keys, self.progress)  # and reserves the budget
            except BaseException:
                self._live.release_all()
                raise
            overrun = self._budget.overrun(self.config, self.registry.captured)
            report = CaptureReport(
                records=records,
                backend=self.backend.name,
                device=str(self.device),
                total_seconds=time.perf_counter() - start,
                pool_bytes=pool_bytes,
                config=self.config.to_dict(),
                warnings=uncompiled_warnings(self.graphs.values(), self.backend.name) + ([overrun] if overrun else []),
                recapture=self._history.completed(replaced, self.stats),
                pending=[str(key) for key in self.registry.pending()] if self._lazy.is_lazy else [],
                memory_budget=self._budget.to_dict(self.config, self.registry.captured, pool_bytes, self.backend),
            )
            if report_path:
                write_report(report, report_path, undo=self._live.release_all)
        memory = format_bytes(report.pool_bytes)
        log.info("captured %d graphs in %.2f s (%s)", len(report.captured), report.total_seconds, memory)
        return report

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
        anew. Tensors the model reaches that appeared since are recorded and checked from then on.

        Fits an engine's idle gap: `max_seconds` counts from this call's first line, a key starts only while time
        is left (the call ends at most one key's capture past it), GC is paused around each key and never
        collected whole; with nothing pending and no peers the call returns at once (`pending()` asks first).
        """
        start = self._lazy.clock()
        check_time_limits(max_seconds, max_keys)
        with self._scope("capture_pending"), beside_engine_threads():  # no process-wide sync-debug mode
            # Under the lock: a resize_kv() waiting for it would otherwise leave the scratch check the old bound.
            def checked() -> CapturePass:  # the refusals, before anything is written
                scratch = scratch_block_ids(scratch_blocks, self.config.kv_cache.num_blocks)
                group_scratch = group_scratch_ids(group_scratch_blocks, self.buffers.limits.kv_groups)
                # A key captured now must read what the live graphs read: one record checks them all.
                self._guard.check_before_capture("capture_pending()", self.model, self.buffers.storage())
                return self._pass_of(scratch, group_scratch)

            if self._peers is None and not self.registry.num_pending:  # peers must still agree that every rank stops
                scratch_block_ids(scratch_blocks, self.config.kv_cache.num_blocks)
                group_scratch_ids(group_scratch_blocks, self.buffers.limits.kv_groups)
                return 0
            job = self._check_ready("capture_pending", checked)
            capture_key = lambda key: self._capture_keys(job, [key], False)  # noqa: E731
            with self._kept.protected():  # the last step's outputs stay valid until the next step
                captured = self._lazy.run(capture_key, max_seconds, max_keys, start=start)
            if captured:  # an idle-time pass: counted as capture() passes are
                self.stats.captures += 1
            return captured

    def pending(self) -> list[GraphKey]:
        """The keys `capture_pending()` would capture, in the order it takes them (most traffic first, then
        largest first); empty when there is nothing to capture (`capture.strategy: upfront` after `capture()`,
        or every key captured or skipped). With peers: this rank's keys (`capture_pending` agrees on the order)."""
        with self._lock:
            return self._lazy.ordered() if self.registry.num_pending else []

    def _capture_keys(self, job: CapturePass, keys: list[GraphKey], progress: bool | None) -> tuple[list, int]:
        """Capture `keys` into the live graphs within the budget (arming the guard first); records, pool growth."""
        fresh = not self.graphs
        if keys and fresh:
            self._guard.arm(self.model, self.buffers.storage())
        kwargs = {"set_aside": self.buffers.table_set_aside, "context": self._capture_context, "progress": progress}
        try:
            records, grown = run_pass(job, self._live, keys, budget=self._budget, **kwargs)
        finally:
            if self._peers is not None:  # what decides whether eager steps pad (`Parallel.pad_eager` None)
                self._peers.learn_collectives(self.graphs.values(), self._communicators)
        self.stats.graphs_captured += sum(record.key in self.graphs for record in records)
        if self._budget.observe(grown, fresh=fresh):
            log.warning("%s", self._budget.overrun(self.config, self.registry.captured))
        return records, grown

    def _capture_pass(self, scratch_blocks: Iterable[int] = (), group_scratch_blocks: Any = None) -> CapturePass:
        scratch = scratch_block_ids(scratch_blocks, self.config.kv_cache.num_blocks)
        group_scratch = group_scratch_ids(group_scratch_blocks, self.buffers.limits.kv_groups)
        return self._pass_of(scratch, group_scratch)

    def _pass_of(self, scratch: tuple[int, ...], group_scratch: Any) -> CapturePass:
        check_scratch_free(scratch, group_scratch, self.block_table, self.kv_group_tables)  # before any write
        return CapturePass(
            backend=self.backend,
            registry=self.registry,
            config=self.config,
            stage=self._stage,
            forward=self._forward if self._ledger is None else self._ledger.wrap(self._forward),
            static_inputs=lambda inputs: self._guard.collect(self.model, inputs.tensors()),
            extras=self.buffers.extras,
            failures=self._failures,
            scratch_blocks=scratch,
            outputs=self._outputs,
            kv_groups=self.buffers.limits.kv_groups,
            group_scratch=group_scratch or {},
            on_captured=key_captured_hook(self._communicators),
            ledger=self._ledger,
            precision=precision_of(self.model),
        )

    def _measure_key(self, key: GraphKey) -> GraphMemory:
        """`key`'s graph memory measured on this model: its dummy batch staged as a warmup's, one forward."""
        run = self._pass_of((), {}).key_run(key)
        shape = self.registry.capture_shape(key)
        return measure_graph(key.num_tokens, shape.num_reqs, run, self.backend)

    def _check_ready(self, call: str, checked: Callable[[], CapturePass]) -> CapturePass:
        """`checked()` (the call's own refusals), then `ConfigError`: `num_warmups: 0` where the backend needs
        warmups (cuda), or a KV cache that shrank without `resize_kv`. With peers, a rank that steps while they
        capture (`call`) fails here, out of step, and a refusal on any rank raises on every rank (one agreement
        carries it), so no rank's pass agreement pairs with a peer's next step."""
        try:
            job = checked()
            try:
                self.backend.check_warmups(self.config.capture.num_warmups)
            except ValueError as exc:
                raise ConfigError([ConfigProblem("capture.num_warmups", str(exc))]) from None
            check_kv_fits(self.config, self.model)
        except Exception as exc:
            if self._peers is not None:
                self._peers.begin_capture(call, exc)
            raise
        if self._peers is not None:
            self._peers.begin_capture(call)
        return job
