"""The CUDA backend: `torch.cuda.CUDAGraph` with one memory pool and side stream per backend.

Every graph of a backend is captured into its pool (`graphcap.backends.pool.GraphPool`,
shared with another backend only on request) on the pool's side stream, so graphs
captured largest first reuse one another's memory; they are replayed one at a time under
the pool's lock. Outputs are not kept alive after capture (owning them would keep every
graph's output out of the pool): `output` is an unowned alias of the memory the graph
writes, valid until any graph of the pool replays.

Warmups run on the side stream: first the preflight (the unsafe-op checker with
torch.compile off, under `set_sync_debug_mode("error")`), then `num_warmups >= 1` plain
runs (compiled, as captured; under sync-debug too with `sync_debug=True`). Capture runs
with no Python mode active, so a torch.compile'd forward is captured compiled.

A failed capture leaves nothing behind, whichever order the running torch ends a failed
capture in (`graphcap.backends.pool.discard_capture`): the allocator stops recording to the
pool, the capture's use of it is released once, and later captures go to a fresh pool (a
failed forward's tensors may still pin the old one). Where `capture_end` did not complete (CUDA
invalidated the capture), the CUDA generators are taken out of capture mode again
(`restore_generators`); CUDA's capture errors and torch's refusal of a pageable copy get a hint
(`graphcap.backends.cuda_recovery`).

Captures use `capture_error_mode="thread_local"` by default (`capture.capture_error_mode`):
capture happens inside a living engine (lazily, beside its other threads), and under
`"global"` any CUDA work another thread issues during a capture (a `cudaMalloc`, a copy on
an unrelated stream) invalidates it. `"global"` is the stricter check for an engine that
captures with no other thread using CUDA; `"relaxed"` lets even the capturing thread make
unsafe calls (debugging only).

The engine's generators (`add_generators`) are registered with every graph and piece before
its capture begins (`graphcap.backends.generators`).

Version-dependent: `check_input_liveness` needs a torch whose `CUDAGraph.capture_begin`
takes it (2.13 and later); asking for it on an older torch is refused when the backend is made.
`generators` need `CUDAGraph.register_generator_state` (feature-detected the same way).

Not done here: `gc` freezing around the capture pass (the manager does it once for all
graphs) and deciding what to capture.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from graphcap.backends.base import Forward, GraphBackend
from graphcap.backends.compiled import eager_only
from graphcap.backends.cuda_pieces import CUDAPieceSession
from graphcap.backends.cuda_recovery import capture_failure, restore_generators
from graphcap.backends.generators import check_generators, register_generators, supports_generator_registration
from graphcap.backends.graph import CapturedGraph
from graphcap.backends.pool import GraphPool, discard_capture, unowned_alias
from graphcap.devices import CAPTURE_ERROR_MODES
from graphcap.errors import CaptureError
from graphcap.outputs import flatten_output

__all__ = [
    "CAPTURE_ERROR_MODES",
    "CUDACapturedGraph",
    "CUDAGraphBackend",
    "reservation_layout",
    "supports_input_liveness",
]

SMALL_REQUEST = 1 << 20
"""The largest request the caching allocator serves from a pool's small blocks (`kSmallSize`)."""
SMALL_SEGMENT = 2 << 20
"""The size of every small-block segment (`kSmallBuffer`): two `SMALL_REQUEST` blocks."""


@dataclass(eq=False, repr=False, kw_only=True)
class CUDACapturedGraph(CapturedGraph):
    """A captured `torch.cuda.CUDAGraph`; replays on the current stream of its device."""

    graph: torch.cuda.CUDAGraph | None = field(default=None, repr=False)
    pool_handle: Any = None
    """The allocator pool id the graph was captured into (kept after `release()`)."""

    @property
    def pool(self) -> Any:
        """The memory pool handle this graph was captured into (also after `release()`)."""
        return self.pool_handle

    def _replay(self) -> None:
        graph = self.graph
        assert graph is not None  # set by the capture; replay() refuses a released graph first
        graph.replay()

    def _release(self) -> None:
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.reset()


class CUDAGraphBackend(GraphBackend):
    """Captures with `CUDAGraph.capture_begin(pool)` / `capture_end()` on the pool's side stream.

    `memory_bytes` of a graph is what the capture took from the device: the larger of the
    growth of `torch.cuda.memory_reserved()` and the drop of free device memory (which
    also sees the driver's graph objects; other processes on the GPU add noise to it).
    Inside a memory-budget reservation that is about 0: the pool already held the memory.
    The cache (device and pinned host) is emptied before every capture, as `torch.cuda.graph`
    does: the allocator cannot free cached blocks while a capture is under way. Emptying it
    frees no block of a pool that still has live graphs (only pools whose use count is zero),
    so later, smaller graphs still reuse the pool's free blocks.

    `check_input_liveness=True` (debug; torch 2.13 and later) has torch track every tensor the
    capture reads and raise at replay if one was freed since; it runs a dispatch mode during
    capture, so a compiled forward is then captured uncompiled (with a warning).
    """

    name = "cuda"
    min_warmups = 1
    _preflight_syncs = True

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        sync_debug: bool = False,
        pool: GraphPool | None = None,
        check_input_liveness: bool = False,
        capture_error_mode: str = CAPTURE_ERROR_MODES[0],
        generators: Any = (),
    ) -> None:
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)}; got {capture_error_mode!r} "
                "(thread_local: captures beside an engine's other threads; global: no other thread may use CUDA)"
            )
        if not torch.cuda.is_available():
            raise CaptureError(
                "graph backend 'cuda' needs CUDA, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); use backend 'emulated', the CPU backend"
            )
        if check_input_liveness and not supports_input_liveness():
            raise CaptureError(
                f"check_input_liveness=True needs torch 2.13 or later (CUDAGraph.capture_begin has no "
                f"check_input_liveness parameter in torch {torch.__version__}); leave it off, or upgrade torch"
            )
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(
                f"graph backend 'cuda' needs a CUDA device; got {device}; "
                "use device 'cuda' / 'cuda:N', or backend 'emulated' for the CPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        generators = _registrable(check_generators(generators, device))
        self._sync_debug = sync_debug
        self.check_input_liveness = check_input_liveness
        self.capture_error_mode = capture_error_mode
        """What `capture_begin` is given (`CAPTURE_ERROR_MODES`)."""
        super().__init__(device, pool)
        self.add_generators(generators)

    def _new_pool(self) -> GraphPool:
        stream = torch.cuda.Stream(device=self.device)
        return GraphPool(
            self.device, torch.cuda.graph_pool_handle, stream, empty_cache=self.empty_cache, reserve=self._reserve_in
        )

    def add_generators(self, generators: Any) -> None:
        super().add_generators(_registrable(check_generators(generators, self.device)))

    @contextlib.contextmanager
    def _warmup_context(self) -> Iterator[None]:
        stream = self.pool.stream
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the side stream must see the staged inputs
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                yield
        finally:
            current.wait_stream(stream)  # later work on the caller's stream sees the warmups

    def _capture(self, fn: Forward, *, name: str, input_ptrs: dict[str, int]) -> CUDACapturedGraph:
        handle = self.pool.handle
        self.synchronize()  # staged uploads and warmups are done; nothing else runs during capture
        reserved_before = torch.cuda.memory_reserved(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graph = torch.cuda.CUDAGraph()
        uncompiled: list[str] = []
        began = [False]  # set once capture_begin returned: what the cleanup must release
        try:
            with torch.cuda.device(self.device):
                if self.check_input_liveness:  # a dispatch mode runs during capture: no compile
                    with eager_only() as uncompiled:
                        output = self._record(graph, fn, handle, began)
                else:
                    output = self._record(graph, fn, handle, began)
            leaves, rebuild = flatten_output(output, name)
            self.synchronize()
        except BaseException as error:
            if not discard_capture(graph, self.device, handle, began=began[0]):
                self.restore_generators(error)
            hinted = capture_failure(name, error)
            if hinted is not None:
                raise hinted from error
            raise
        reserved_delta = torch.cuda.memory_reserved(self.device) - reserved_before
        free_delta = free_before - torch.cuda.mem_get_info(self.device)[0]
        return CUDACapturedGraph(
            name=name,
            output=rebuild([unowned_alias(leaf) for leaf in leaves]),  # the pool keeps the memory
            input_ptrs=input_ptrs,
            memory_bytes=max(0, reserved_delta, free_delta),
            graph_pool=self.pool,
            uncompiled=tuple(uncompiled),
            graph=graph,
            pool_handle=handle,
        )

    def _record(self, graph: torch.cuda.CUDAGraph, fn: Forward, handle: Any, began: list[bool]) -> torch.Tensor:
        """Capture fn on the pool's stream; on failure fn's own error wins over capture_end's.

        Sets `began[0]` once `capture_begin` returned.
        """
        stream = self.pool.stream
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        liveness = {"check_input_liveness": True} if self.check_input_liveness else {}
        with torch.cuda.stream(stream):
            register_generators(graph, self.generators)  # before capture_begin, or torch ignores them
            graph.capture_begin(pool=handle, capture_error_mode=self.capture_error_mode, **liveness)
            began[0] = True
            try:
                output = fn()
            except BaseException:
                # Ending a capture that fn broke may raise a second, less telling error
                # (capture invalidated); the user needs fn's. discard_capture cleans up after both.
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
        caller.wait_stream(stream)
        return output

    def restore_generators(self, error: BaseException | None = None) -> None:
        """After a capture whose `capture_end` did not complete: the CUDA generators out of capture mode.

        Without it every eager random draw of the default or a registered generator fails until a
        capture succeeds (`graphcap.backends.cuda_recovery`). If CUDA refuses (a sticky error), `error`
        (the capture's own, which propagates) gets a note saying so.
        """
        try:
            restore_generators(self.device, self.pool.stream, self.generators, self.capture_error_mode)
        except Exception as exc:
            if error is not None and hasattr(error, "add_note"):  # Python 3.11 and later
                error.add_note(f"graphcap could not take the CUDA generators out of capture mode: {exc}")

    def _piece_session(self, name: str) -> CUDAPieceSession:
        self.synchronize()  # staged uploads and warmups are done; nothing else runs during capture
        return CUDAPieceSession(self, name)

    def _reserve_in(self, handle: Any, num_bytes: int) -> tuple[Any, int]:
        """`GraphPool`'s reserve: allocate `num_bytes` inside pool `handle` once and free them there.

        The caching allocator keeps those segments for the pool (an empty graph captured into it holds
        the pool's use until the returned call resets it), so later captures, lazy ones late in the
        engine's life included, take memory the pool already holds. The bytes are split as
        `reservation_layout` says: most in one large block (what requests over 1 MiB are carved from),
        the rest as small-block segments (what requests of 1 MiB or less take), all allocated together.
        The cache (device and pinned host) is emptied first, as before every capture: the allocator
        cannot free cached blocks while the holder captures, so with free memory below the budget but
        enough of it cached the reservation would fail out of memory.
        Returns (give it back, the growth of `torch.cuda.memory_reserved()`).
        """
        self.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        large, small_segments = reservation_layout(num_bytes)
        graph = torch.cuda.CUDAGraph()
        stream, caller = self.pool.stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the CUDA graph is empty": it only holds memory
                graph.capture_begin(pool=handle, capture_error_mode=self.capture_error_mode)
                try:
                    held = [torch.empty(large, dtype=torch.uint8, device=self.device)] if large else []
                    # Alive together, so each pair of 1 MiB blocks takes a segment of its own.
                    held += [
                        torch.empty(SMALL_REQUEST, dtype=torch.uint8, device=self.device)
                        for _ in range(2 * small_segments)
                    ]
                    del held  # freed at once, kept by the pool
                finally:
                    graph.capture_end()
        except BaseException as error:  # out of memory: the holder's use of the pool goes back now, not at its GC
            if not discard_capture(graph, self.device, handle):
                self.restore_generators(error)
            raise
        caller.wait_stream(stream)
        return graph.reset, torch.cuda.memory_reserved(self.device) - before

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        self.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned host memory (torch.cuda.graph does it)
        if host_empty is not None:
            host_empty()

    def memory_in_use(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def free_memory(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0]


def supports_input_liveness() -> bool:
    """Whether this torch's `CUDAGraph.capture_begin` takes `check_input_liveness` (torch 2.13 and later)."""
    try:
        parameters = inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
    except (TypeError, ValueError):  # a C method without a signature: the older binding
        return False
    return "check_input_liveness" in parameters


def reservation_layout(num_bytes: int) -> tuple[int, int]:
    """How a reservation of `num_bytes` is allocated: (bytes of one large block, small-block segments).

    1/64 of the budget, at least one and at most 32 segments of 2 MiB (within the budget), goes to
    the pool's small blocks; the rest is one large block. Requests of 1 MiB or less (most tensors
    of a decode step) are only ever served from small blocks, so without them each capture would
    still take fresh 2 MiB segments outside the budget.
    """
    small = min(max(num_bytes // 64, SMALL_SEGMENT), 32 * SMALL_SEGMENT, num_bytes)
    segments = small // SMALL_SEGMENT
    return num_bytes - segments * SMALL_SEGMENT, segments


def _registrable(generators: tuple) -> tuple:
    """`generators`, or `CaptureError` when there are some and this torch cannot register them."""
    if generators and not supports_generator_registration():
        raise CaptureError(
            f"generators= needs CUDAGraph.register_generator_state, which torch {torch.__version__} lacks; "
            "upgrade torch, or draw random numbers outside the graph"
        )
    return generators
