"""The backend protocol and the orchestration every backend shares.

A backend captures a zero-argument forward closure into a `CapturedGraph` and replays it.
This module owns everything that does not need a GPU, so the CPU tests exercise it
through the emulated backend: the registry of live graphs (`CapturedGraph` lives in
`graphcap.backends.graph`), the pool (`graphcap.backends.pool`), the warmup loop (a
separate, checked first run, then plain ones), argument validation and the rules on call
order (captures do not nest; nothing is warmed up, captured or reset while a capture is
under way).

Subclasses implement `_capture` (which must leave nothing behind when it raises),
`_replay`/`_release` on their graph class, and the memory queries. Apart from errors only
they can explain (a capture CUDA invalidated), they do not wrap errors: a
`CaptureUnsafeError` and any other exception (`torch.OutOfMemoryError` included)
propagate unchanged; the manager adds the graph key and a hint.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from graphcap.backends.compiled import uncompiled_warning
from graphcap.backends.generators import check_generators
from graphcap.backends.graph import CapturedGraph, is_sticky_cuda_error, record_input_ptrs
from graphcap.backends.pool import GraphPool
from graphcap.backends.preflight import preflight
from graphcap.backends.reads import ExternalReads
from graphcap.backends.sync_debug import engine_threads_may_run, sync_debug_errors
from graphcap.errors import CaptureError, CaptureUnsafeError, StaticInputMovedError
from graphcap.phases import in_phase, recording

__all__ = [
    "CaptureError",
    "CaptureUnsafeError",
    "CapturedGraph",
    "Forward",
    "GraphBackend",
    "StaticInputMovedError",
    "is_sticky_cuda_error",
]

Forward = Callable[[], Any]
"""A forward closure: no arguments, reads its static inputs itself, returns a tensor (or a
tuple, list or dict of tensors: see `graphcap.outputs.flatten_output`)."""


class GraphBackend:
    """Captures forward closures into graphs on one device, in one pool, and keeps the live ones.

    Does not decide what to capture, stage inputs, wrap errors with graph keys or manage
    `gc`: that is the manager's job. Call order: `warmup` then `capture` per key; never
    from inside a forward being captured.
    """

    name: str
    device: torch.device
    min_warmups = 0
    """Plain warmups `warmup` requires before a capture (cuda: 1)."""
    checks_in_capture = False
    """Whether `capture` runs its forward under every check of the preflight, raising the same errors (the emulated
    backend records the forward under the unsafe-op checker, torch.compile off, its generators registered): a
    capture pass then warms up a full graph's key that has plain warmups with `warmup(..., checked=False)`: one
    checked forward, not two."""
    _preflight_syncs = False  # run the preflight under set_sync_debug_mode("error") (cuda)
    _sync_debug = False  # run the plain warmups under it too (cuda, `sync_debug=True`)

    def __init__(self, device: torch.device | str, pool: GraphPool | None = None) -> None:
        self.device = torch.device(device)
        self.pool = pool if pool is not None else self._new_pool()
        """The memory pool of this backend's graphs (shared with others only on request)."""
        self._reads: ExternalReads | None = None  # the last preflight's, until the next capture takes them
        self._graphs: list[CapturedGraph] = []
        self._is_capturing = False
        self.generators: tuple[torch.Generator, ...] = ()
        """Generators registered with every graph before its capture begins (`add_generators`)."""

    @property
    def reserved_bytes(self) -> int | None:
        """Bytes `reserve` set aside in this backend's pool (None: nothing reserved; shared with the
        backends sharing the pool)."""
        return self.pool.reserved_bytes

    @property
    def graphs(self) -> tuple[CapturedGraph, ...]:
        """The live (captured, not released) graphs, in capture order."""
        self._graphs = [g for g in self._graphs if not g.is_released]
        return tuple(self._graphs)

    def add_generators(self, generators: Any) -> None:
        """Register `generators` (`torch.Generator`s of this backend's device) with every later capture.

        An engine's own generators (a sampler's): the CUDA backend registers each with every graph and
        piece before its capture begins; the preflight names a random op drawing from any other
        non-default CUDA generator. All are checked before any is kept (`TypeError`/`ValueError`
        naming `generators[i]`); one already given is not added twice.
        """
        found = check_generators(generators, self.device)
        self.generators += tuple(g for i, g in enumerate(found) if not _among(g, (*self.generators, *found[:i])))

    def warmup(self, fn: Forward, num_warmups: int, *, checked: bool = True) -> None:
        """Run the preflight of `fn` once, then call it eagerly `num_warmups` more times.

        The preflight runs `fn` under the unsafe-op checker with torch.compile off (and on
        CUDA under `set_sync_debug_mode("error")`, which is process-wide: not turned on beside
        an engine's threads, i.e. in `capture_pending`, unless `sync_debug` asks for it; see
        `graphcap.backends.sync_debug`), and names an op a CUDA graph cannot hold as
        `CaptureUnsafeError` (op, reason, user file:line). The plain warmups then run `fn`
        as capture will: compiled, lazy libraries initialised. All under
        `torch.inference_mode()`, like capture.

        `checked=False`: no preflight, the plain warmups alone; only on a backend whose `capture` runs the
        preflight's checks itself (`checks_in_capture`), for a forward it captures next (`ValueError` elsewhere).
        """
        self.check_warmups(num_warmups)
        _check_callable(fn)
        self._check_not_capturing("warmup()")
        if not checked and not self.checks_in_capture:
            raise ValueError(
                f"warmup(checked=False) on the {self.name} backend: its capture does not run the preflight's checks, "
                "so the preflight must run here; drop checked=False"
            )
        syncs = self._preflight_syncs and (self._sync_debug or not engine_threads_may_run())
        self._reads = None
        with self._warmup_context(), torch.inference_mode(), in_phase("warmup"):
            if checked:
                reads = ExternalReads()  # what the graph captured next reads (`CapturedGraph.reads`)
                with preflight(self.device, sync_debug=syncs, generators=self.generators, reads=reads):
                    fn()
                self._reads = reads
            with sync_debug_errors(self._sync_debug):
                for _ in range(num_warmups):
                    fn()

    def check_warmups(self, num_warmups: int) -> None:
        """`ValueError` unless `num_warmups` is an int of at least `min_warmups` (what `warmup` needs)."""
        if isinstance(num_warmups, bool) or not isinstance(num_warmups, int) or num_warmups < 0:
            raise ValueError(f"num_warmups must be an int >= 0; got {num_warmups!r}")
        if num_warmups < self.min_warmups:
            raise ValueError(
                f"{num_warmups} is too few for the {self.name} backend: it needs at least {self.min_warmups} plain "
                "warmup before each capture, so that lazy initialisation (cuBLAS workspaces, Triton autotuning, "
                f"torch.compile, NCCL communicators) happens outside the graph; set capture.num_warmups to "
                f"{self.min_warmups} or more"
            )

    def capture(
        self,
        fn: Forward,
        static_inputs: Mapping[str, torch.Tensor],
        *,
        name: str,
    ) -> CapturedGraph:
        """Capture `fn` (no arguments; it reads `static_inputs` itself) into a graph.

        Records each static input's `data_ptr`. Returns the graph, registered with this
        backend, in this backend's pool; read `graph.output` only after a replay (on CUDA
        capture runs nothing). On failure nothing stays registered or allocated, later
        captures go to a fresh pool, and the exception propagates. Warns when
        torch.compile'd code was captured uncompiled (`graph.uncompiled`).
        """
        _check_callable(fn)
        input_ptrs = record_input_ptrs(static_inputs)
        with self._capturing("capture()"):
            graph = self._capture(fn, name=name, input_ptrs=input_ptrs)
        return self._register(graph, static_inputs, name)

    def capture_pieces(
        self,
        fn: Callable[[Any], Any],
        static_inputs: Mapping[str, torch.Tensor],
        *,
        name: str,
    ) -> CapturedGraph:
        """Capture `fn(session)` as pieces cut at every `eager_op` call (see `graphcap.backends.pieces`).

        `fn` runs the forward with `session` as the current piecewise session
        (`graphcap.piecewise.running(inputs, "piecewise", session)`). Same contract as
        `capture`: nothing stays registered or allocated on failure, later captures go to a
        fresh pool.
        """
        _check_callable(fn)
        input_ptrs = record_input_ptrs(static_inputs)
        with self._capturing("capture_pieces()"):
            session = self._piece_session(name)
            try:
                session.begin_piece()
                graph = session.finish(fn(session), input_ptrs)
            except BaseException:
                session.abort()
                raise
        return self._register(graph, static_inputs, name)

    @contextlib.contextmanager
    def _capturing(self, what: str) -> Iterator[None]:
        """One capture at a time, under inference mode; a failure rotates the pool.

        A failed forward's tensors may still pin blocks of the old pool, and CUDA may have left
        the allocator recording to it: later captures must not go there.
        """
        self._check_not_capturing(what)
        # As torch.cuda.graph does before every capture: during a capture the allocator cannot free
        # cached blocks to satisfy an allocation (the capture would fail out of memory while memory is
        # only cached). It frees no block of a pool that still has live graphs.
        self.empty_cache()
        self._is_capturing = True
        try:
            with torch.inference_mode(), recording():  # graphcap.is_capturing() is true inside
                yield
        except BaseException:
            self.pool.rotate()  # a failed capture may leave the pool pinned or recording
            raise
        finally:
            self._is_capturing = False

    def _register(self, graph: CapturedGraph, static_inputs: Mapping[str, torch.Tensor], name: str) -> CapturedGraph:
        """Count the graph live in the pool, check the inputs' addresses again, warn about uncompiled code. A graph
        whose recording collected no `reads` gets those of the preflight that warmed it up (`warmup`)."""
        reads, self._reads = self._reads, None
        if graph.reads is None and reads is not None:
            graph.reads = tuple(reads.tensors())
        graph.hold()  # before anything can release it: the last release of a handle rotates the pool
        try:
            # fn may have resized or `set_()` a buffer while it ran; the graph would then
            # hold an address the caller no longer uses.
            graph.check_addresses(static_inputs)
        except StaticInputMovedError:
            graph.release()
            raise
        if graph.uncompiled:
            warnings.warn(uncompiled_warning(self.name, name, graph.uncompiled), UserWarning, stacklevel=3)
        self._graphs.append(graph)
        return graph

    def _piece_session(self, name: str) -> Any:
        raise NotImplementedError(f"the {self.name} backend cannot capture piecewise graphs")

    def reset(self) -> None:
        """Release every graph this backend captured; later captures go to a fresh pool."""
        self._check_not_capturing("reset()")
        for graph in self._graphs:
            graph.release()
        self._graphs = []
        self.pool.release_reservation()
        self.pool.rotate()
        # After a sticky CUDA error every CUDA call fails with it: the reset must not replace
        # the error that ended the pass with a second copy of it.
        with contextlib.suppress(Exception):
            self.empty_cache()

    def reserve(self, num_bytes: int) -> int:
        """Set `num_bytes` aside for later captures into this backend's pool (`capture.memory_budget`).

        Returns the device memory the reservation took (`GraphPool.reserve`: once per pool, held until
        `reset`, moved with the pool when it rotates). The emulated backend allocates nothing (its graphs
        own private memory): it records the number, and the manager keeps the budget by graphcap's estimate.
        """
        self._check_not_capturing("reserve()")
        return self.pool.reserve(num_bytes)

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work."""

    def empty_cache(self) -> None:
        """Return cached, unused device memory (before every capture, and after a release)."""

    def memory_in_use(self) -> int:
        raise NotImplementedError

    def free_memory(self) -> int | None:
        """Free device memory in bytes, or None where the notion does not apply."""
        return None

    def _new_pool(self) -> GraphPool:
        return GraphPool(self.device)

    def _capture(self, fn: Forward, *, name: str, input_ptrs: dict[str, int]) -> CapturedGraph:
        raise NotImplementedError

    def _warmup_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _check_not_capturing(self, what: str) -> None:
        if self._is_capturing:
            raise CaptureError(
                f"{what} called on the {self.name} backend while a capture is under way; "
                "captures do not nest: call it outside the forward being captured"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, {len(self.graphs)} graphs)"


def _among(generator: torch.Generator, others: tuple) -> bool:
    return any(generator is other for other in others)


def _check_callable(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments; got {type(fn).__name__}")
