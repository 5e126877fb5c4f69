"""`Capturer`: the capture half of `CaptureManager` (`capture()`, `capture_pending()`, `pending()`) and its pass loop.

The manager holds one, built once from its `CaptureParts`. A pass splits the keys by the memory budget, holds GC
still (`gc_hold`) and sets the persistent block tables aside, holds the budget's reservation, then per key records
(`Recorder`), verifies (`Verifier`: right after the recording when no engine context is to be left and there are
no peers, else after the context exits) and, when `capture.min_speedup` decides, times it; what passed goes to the
live graphs (`LiveGraphs.install`). It does not decide which keys (the manager and `LazyCapture` do).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from graphcap.backends import CapturedGraph, GraphBackend
from graphcap.backends.sync_debug import beside_engine_threads
from graphcap.capture.gc_hold import gc_frozen
from graphcap.capture.lazy import check_time_limits
from graphcap.capture.lifecycle import check_kv_fits
from graphcap.capture.outcome import KeyOutcome, Recorded, Verified
from graphcap.capture.parts import CaptureParts
from graphcap.capture.recorder import Recorder, capture_reqs
from graphcap.capture.references import SharedReferences, expected_probes
from graphcap.capture.restore import caches_of, kept_blocks
from graphcap.capture.verification import LastRun
from graphcap.capture.verifier import Scratch, Verifier
from graphcap.checks.sampling import Cache
from graphcap.communicators import key_captured_hook
from graphcap.config import CaptureConfig
from graphcap.config.byte_counts import format_bytes
from graphcap.distributed.admission import agreed_admission
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.keys import GraphKey, Mode
from graphcap.memory.budget import OVER_BUDGET
from graphcap.memory.estimate import GraphMemory
from graphcap.memory.measured import measure_graph
from graphcap.model_facts import precision_of
from graphcap.probe import check_scratch_free, group_scratch_ids, scratch_block_ids
from graphcap.report import CaptureReport, GraphRecord, write_report
from graphcap.report_files import check_report_path

__all__ = ["EMULATED_CAPTURE_THREADS", "Capturer", "progress_bar", "uncompiled_warnings"]

log = logging.getLogger("graphcap")

EMULATED_CAPTURE_THREADS = 1
"""torch CPU threads while the emulated backend captures, unless `capture.num_threads` says otherwise: on a loaded
shared VM a pass on one thread took 0.11-0.20x the time of one on two (docs/BENCHMARKS.md, "Capture threads on
the emulated backend"; idle, the two were within 0.8-1.2x)."""


class Capturer:
    """Captures the keys of one manager with `parts`: the manager's `capture()`, `capture_pending()`, `pending()`."""

    def __init__(self, parts: CaptureParts) -> None:
        self.parts = parts

    def capture(
        self, *, scratch_blocks: Iterable[int] = (), group_scratch_blocks: Mapping[str, Iterable[int]] | None = None
    ) -> CaptureReport:
        """`CaptureManager.capture` (see its docstring)."""
        parts = self.parts
        report_path = parts.config.report.path

        def checked() -> Scratch:  # the refusals, before anything is written
            if report_path:
                check_report_path(report_path)
            return self.scratch(scratch_blocks, group_scratch_blocks)  # checks the scratch blocks first

        live, lazy, registry = parts.live, parts.lazy, parts.registry
        with parts.scope("capture"):
            # Under the lock: a resize_kv() waiting for it would otherwise leave the pass the old KV bound.
            scratch = self.check_ready("capture", checked)
            replaced = len(live.graphs)
            live.release_all("pending" if lazy.is_lazy else "not_captured")
            keys = [] if lazy.is_lazy else registry.capture_order()  # lazy: capture_pending() later
            start = time.perf_counter()
            try:
                records, pool_bytes = self.capture_keys(scratch, keys, parts.progress)  # and reserves the budget
            except BaseException:
                live.release_all()
                raise
            config, budget, backend = parts.config, parts.budget, parts.backend
            overrun = budget.overrun(config, registry.captured)
            report = CaptureReport(
                records=records,
                backend=backend.name,
                device=str(parts.device),
                total_seconds=time.perf_counter() - start,
                pool_bytes=pool_bytes,
                config=config.to_dict(),
                warnings=uncompiled_warnings(live.graphs.values(), backend.name) + ([overrun] if overrun else []),
                recapture=parts.history.completed(replaced, parts.stats),
                pending=[str(key) for key in registry.pending()] if lazy.is_lazy else [],
                memory_budget=budget.to_dict(config, registry.captured, pool_bytes, backend),
            )
            if report_path:
                write_report(report, report_path, undo=live.release_all)
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
        """`CaptureManager.capture_pending` (see its docstring)."""
        parts = self.parts
        start = parts.lazy.clock()
        check_time_limits(max_seconds, max_keys)
        with parts.scope("capture_pending"), beside_engine_threads():  # no process-wide sync-debug mode
            # Under the lock: a resize_kv() waiting for it would otherwise leave the scratch check the old bound.
            def checked() -> Scratch:  # the refusals, before anything is written
                blocks = scratch_block_ids(scratch_blocks, parts.config.kv_cache.num_blocks)
                groups = group_scratch_ids(group_scratch_blocks, parts.kv_groups)
                if parts.live.graphs:  # a key captured now must read what the live graphs read: one record checks all
                    parts.guard.check_before_capture("capture_pending()", parts.model, parts.buffers.storage())
                else:  # no graph alive (the first keys failed or were dropped): nothing reads the old record
                    parts.guard.disarm()
                return self._checked(blocks, groups)

            if parts.peers is None and not parts.registry.num_pending:  # peers must still agree that every rank stops
                scratch_block_ids(scratch_blocks, parts.config.kv_cache.num_blocks)
                group_scratch_ids(group_scratch_blocks, parts.kv_groups)
                return 0
            scratch = self.check_ready("capture_pending", checked)
            capture_key = lambda key: self.capture_keys(scratch, [key], False)  # noqa: E731
            with parts.kept.protected():  # the last step's outputs stay valid until the next step
                captured = parts.lazy.run(capture_key, max_seconds, max_keys, start=start)
            if captured:  # an idle-time pass: counted as capture() passes are
                parts.stats.captures += 1
            return captured

    def pending(self) -> list[GraphKey]:
        """`CaptureManager.pending` (see its docstring)."""
        with self.parts.scope.lock:
            return self.parts.lazy.ordered() if self.parts.registry.num_pending else []

    def capture_keys(
        self, scratch: Scratch, keys: list[GraphKey], progress: bool | None
    ) -> tuple[list[GraphRecord], int]:
        """Capture `keys` into the live graphs within the budget (arming the guard first); records, pool growth."""
        parts = self.parts
        fresh = not parts.live.graphs
        if keys and fresh:
            parts.guard.arm(parts.model, parts.buffers.storage())
        try:
            with kept_blocks(parts, scratch, keys, self.caches()) as used:  # put back what the probes wrote
                outcomes, grown = self._run_pass(used, keys, progress)
        finally:
            if parts.peers is not None:  # what decides whether eager steps pad (`Parallel.pad_eager` None)
                parts.peers.learn_collectives(parts.live.graphs.values(), parts.communicators)
        parts.stats.graphs_captured += sum(outcome.key in parts.live.graphs for outcome in outcomes)
        if parts.budget.observe(grown, fresh=fresh):
            log.warning("%s", parts.budget.overrun(parts.config, parts.registry.captured))
        return [outcome.record() for outcome in outcomes], grown

    def caches(self) -> list[Cache]:
        """The KV caches the model holds (the built-in one and each group's), found by their shapes."""
        parts = self.parts
        kv = parts.config.kv_cache
        shapes: list[tuple[str | None, int, int]] = [(None, kv.block_size, kv.num_blocks)]
        shapes += [(g.name, g.block_size, g.num_blocks) for g in parts.kv_groups]
        return caches_of(parts.model, parts.guard.registered, shapes)

    def scratch(self, blocks: Iterable[int] = (), groups: Mapping[str, Iterable[int]] | None = None) -> Scratch:
        """The scratch blocks a pass's probes may write, checked (in range, free in every block table)."""
        parts = self.parts
        return self._checked(
            scratch_block_ids(blocks, parts.config.kv_cache.num_blocks), group_scratch_ids(groups, parts.kv_groups)
        )

    def _checked(self, blocks: tuple[int, ...], groups: Mapping[str, tuple[int, ...]]) -> Scratch:
        tables = self.parts.buffers
        check_scratch_free(blocks, groups, tables.block_table, tables.kv_groups.tables)  # before any write
        return Scratch(blocks, dict(groups))

    def measure_key(self, key: GraphKey) -> GraphMemory:
        """`key`'s graph memory measured on this model: its dummy batch staged as a warmup's, one forward."""
        parts = self.parts
        num_reqs = capture_reqs(parts.registry, key)
        return measure_graph(key.num_tokens, num_reqs, Recorder(parts).key_run(key), parts.backend)

    def check_ready(self, call: str, checked: Callable[[], Scratch]) -> Scratch:
        """`checked()` (the call's own refusals), then `ConfigError`: `num_warmups: 0` where the backend needs
        warmups (cuda), or a KV cache that shrank without `resize_kv`. With peers, a rank that steps while they
        capture (`call`) fails here, out of step, and a refusal on any rank raises on every rank (one agreement
        carries it), so no rank's pass agreement pairs with a peer's next step."""
        parts = self.parts
        try:
            scratch = checked()
            try:
                parts.backend.check_warmups(parts.config.capture.num_warmups)
            except ValueError as exc:
                raise ConfigError([ConfigProblem("capture.num_warmups", str(exc))]) from None
            check_kv_fits(parts.config, parts.model)
        except Exception as exc:
            if parts.peers is not None:
                parts.peers.begin_capture(call, exc)
            raise
        if parts.peers is not None:
            parts.peers.begin_capture(call)
        return scratch

    def _run_pass(self, scratch: Scratch, keys: list[GraphKey], progress: bool | None) -> tuple[list[KeyOutcome], int]:
        """Capture and verify `keys` within the budget, and keep what passed in the live graphs.

        GC is held still (`gc_frozen`; inside a lazy key's `gc_paused` it does nothing) and the block tables set
        aside meanwhile; the budget is reserved in the pool once (`LiveGraphs.reserve`); the backend empties the
        allocator's cache before each capture (`GraphBackend.capture`). Returns every key's outcome, in `keys`
        order, and the device memory the capture added. On an exception the graphs of `keys` are released, those
        kept before stay.
        """
        parts = self.parts
        backend, live, budget = parts.backend, parts.live, parts.budget
        if not keys:  # a lazy capture(): nothing to capture now, the budget reserved for later
            live.reserve(budget)
            return [], 0
        admitted, over = budget.split(parts.config, keys, parts.registry.captured)
        if parts.peers is not None and budget.limit is not None:  # every rank keeps a key only if every rank can
            admitted, over = agreed_admission(parts.peers, keys, admitted, over)
        declined = [KeyOutcome(r.key, "skipped", 0.0, message=r.reason, eager_reason=OVER_BUDGET) for r in over]
        collect_first = backend.name == "cuda"  # dead cycles holding device memory; the emulated backend has none
        with (
            gc_frozen(collect_first=collect_first),
            logging_redirect_tqdm(),
            parts.buffers.table_set_aside(),
            _capture_threads(backend, parts.config),
        ):
            live.reserve(budget)  # the backend empties the allocator's cache before each capture, this holder's too
            memory_before = backend.memory_in_use()
            outcomes, graphs = self._run_keys(scratch, admitted, progress) if admitted else ([], {})
        live.install(outcomes + declined, graphs)
        order = {key: i for i, key in enumerate(keys)}
        outcomes = sorted(outcomes + declined, key=lambda outcome: order[outcome.key])
        return outcomes, max(0, backend.memory_in_use() - memory_before)

    def _run_keys(
        self, scratch: Scratch, keys: list[GraphKey], progress: bool | None
    ) -> tuple[list[KeyOutcome], dict[GraphKey, CapturedGraph]]:
        """Record `keys` in order inside the engine's context, verify each (`checks.verify_replay`), and time each
        where `capture.min_speedup` decides. Every key's outcome, and the graphs captured and verified; on any
        exception the graphs recorded so far are released before it propagates."""
        parts = self.parts
        config = parts.config
        references = SharedReferences.for_pass(parts.failures.peers, parts.ledger)
        recorder = Recorder(parts)
        verifier = Verifier(parts, references, recorder, scratch=scratch, precision=precision_of(parts.model))
        on_captured = key_captured_hook(parts.communicators)
        verify = config.checks.verify_replay
        if verify:  # what a kept probe result is kept for
            references.expect(expected_probes(parts.registry, keys, max_model_len=config.kv_cache.max_model_len))
        # With no engine context to leave and no peers, each key is verified right after its capture, against
        # its last warmup's output (an eager run of the same batch): one forward less per key.
        inline = verify and parts.context is contextlib.nullcontext and parts.failures.peers is None
        done: list[Verified] = []
        deferred: list[Recorded] = []  # recorded, to verify after the context
        graphs: dict[GraphKey, CapturedGraph] = {}
        try:
            with parts.context():
                for key in progress_bar(keys, parts.backend, progress):
                    full = parts.registry.mode_of(key) is not Mode.PIECEWISE
                    reference = LastRun() if inline and full else None
                    recorded = recorder.record(key, reference=reference)
                    if recorded.graph is not None:
                        graphs[key] = recorded.graph
                        if on_captured is not None:
                            on_captured(key)
                    if inline:
                        done.append(self._settled(verifier.verify(recorded, reference), graphs))
                    else:
                        deferred.append(recorded)
            if verify and not inline:  # after the context: the engine registered its buffers
                done = [self._settled(verifier.verify(recorded), graphs) for recorded in deferred]
            elif not inline:
                done = [Verified(*recorded) for recorded in deferred]
            if config.capture.min_speedup is not None:  # what each graph buys, timed again when a minimum decides
                done = [self._settled(verifier.timed(item), graphs) for item in done]
        except BaseException:
            for graph in graphs.values():
                graph.release()
            raise
        finally:
            references.clear()  # device memory, on CUDA: gone before the pass's growth is measured
        return [item.outcome for item in done], graphs

    @staticmethod
    def _settled(verified: Verified, graphs: dict[GraphKey, CapturedGraph]) -> Verified:
        """`verified`, its key out of `graphs` when it keeps no graph (the stage that refused it released it)."""
        if verified.graph is None:
            graphs.pop(verified.outcome.key, None)
        return verified


@contextmanager
def _capture_threads(backend: GraphBackend, config: CaptureConfig) -> Iterator[None]:
    """torch's CPU threads set for an emulated pass (`capture.num_threads`, default `EMULATED_CAPTURE_THREADS`)
    and restored after it; another backend's passes keep torch's setting."""
    if backend.name != "emulated":
        yield
        return
    wanted = config.capture.num_threads or EMULATED_CAPTURE_THREADS
    was = torch.get_num_threads()
    if wanted == was:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(was)


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
