"""The CUDA backend: `torch.cuda.CUDAGraph`, one shared memory pool and side stream per device.

Every graph on a device is captured into the same pool (`torch.cuda.graph_pool_handle()`)
on the same side stream, so graphs captured largest first reuse one another's memory;
they must then be replayed one at a time, which is how the manager uses them. Warmups
run on that side stream too, the first under the unsafe-op checker (a preflight that
names an illegal op by aten name and user file:line instead of CUDA error 900), and all
of them under `torch.cuda.set_sync_debug_mode("error")` when built with `sync_debug`.

Not done here: `gc` freezing around the capture pass (the manager does it once for all
graphs) and deciding what to capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from graphcap.backends.base import CapturedGraph, Forward, GraphBackend, check_output
from graphcap.backends.unsafe import unsafe_op_checker
from graphcap.errors import CaptureError

__all__ = ["CUDAGraphBackend", "CUDACapturedGraph"]

# device index -> (pool handle, side stream), shared by every backend in the process.
_DEVICE_STATE: dict[int, tuple[object, torch.cuda.Stream]] = {}


def _device_state(device: torch.device) -> tuple[object, torch.cuda.Stream]:
    state = _DEVICE_STATE.get(device.index)
    if state is None:
        state = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
        _DEVICE_STATE[device.index] = state
    return state


class CUDACapturedGraph(CapturedGraph):
    """A captured `torch.cuda.CUDAGraph`; replays on the current stream of its device."""

    def __init__(
        self,
        *,
        name: str,
        output: torch.Tensor,
        input_ptrs: dict[str, int],
        memory_bytes: int,
        graph: torch.cuda.CUDAGraph,
    ) -> None:
        super().__init__(name=name, output=output, input_ptrs=input_ptrs, memory_bytes=memory_bytes)
        self._graph: torch.cuda.CUDAGraph | None = graph

    @property
    def pool(self) -> object:
        """The memory pool handle this graph was captured into (shared per device)."""
        return self._graph.pool()

    def _replay(self) -> None:
        self._graph.replay()

    def _release(self) -> None:
        graph, self._graph = self._graph, None
        graph.reset()


class CUDAGraphBackend(GraphBackend):
    """Captures with `torch.cuda.graph(g, pool=shared_pool, stream=side_stream)`.

    `memory_bytes` of a graph is what the capture took from the device: the larger of the
    growth of `torch.cuda.memory_reserved()` and the drop of free device memory (which
    also sees the driver's graph objects; other processes on the GPU add noise to it).
    """

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", *, sync_debug: bool = False) -> None:
        if not torch.cuda.is_available():
            raise CaptureError(
                "graph backend 'cuda' needs CUDA, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); use backend 'emulated', the CPU backend"
            )
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(
                f"graph backend 'cuda' needs a CUDA device; got {device}; "
                "use device 'cuda' / 'cuda:N', or backend 'emulated' for the CPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self._sync_debug = sync_debug

    @contextlib.contextmanager
    def _warmup_context(self) -> Iterator[None]:
        _, stream = _device_state(self.device)
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the side stream must see the staged inputs
        previous_mode = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if self._sync_debug:
                    torch.cuda.set_sync_debug_mode("error")
                yield
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            current.wait_stream(stream)  # later work on the caller's stream sees the warmups

    def _capture(
        self,
        fn: Forward,
        *,
        name: str,
        input_ptrs: dict[str, int],
    ) -> CUDACapturedGraph:
        pool, stream = _device_state(self.device)
        # torch.cuda.graph empties the cache on entry; doing it before measuring keeps that
        # release out of this graph's delta.
        self.synchronize()
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device):
                output = _capture_into(graph, fn, pool, stream, self.device)
            check_output(output, name)
            self.synchronize()
        except BaseException:
            _discard(graph, self.device)
            raise
        reserved_delta = torch.cuda.memory_reserved(self.device) - reserved_before
        free_delta = free_before - torch.cuda.mem_get_info(self.device)[0]
        return CUDACapturedGraph(
            name=name,
            output=output,
            input_ptrs=input_ptrs,
            memory_bytes=max(0, reserved_delta, free_delta),
            graph=graph,
        )

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_in_use(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def free_memory(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0]

    def _reset_pool(self) -> None:
        # Graphs are gone; a fresh pool for the next capture lets the allocator free this one.
        self.synchronize()
        _DEVICE_STATE.pop(self.device.index, None)
        torch.cuda.empty_cache()


def _capture_into(
    graph: torch.cuda.CUDAGraph,
    fn: Forward,
    pool: object,
    stream: torch.cuda.Stream,
    device: torch.device,
) -> torch.Tensor:
    """Run fn under `torch.cuda.graph` and the checker; on failure, fn's own error wins."""
    caller_stream = torch.cuda.current_stream(device)
    context = torch.cuda.graph(graph, pool=pool, stream=stream)
    try:
        context.__enter__()
        try:
            with unsafe_op_checker(device):
                output = fn()
        except BaseException as error:
            # Ending a capture that fn broke raises a second, less telling error (capture
            # invalidated); the user needs fn's, so that one propagates.
            with contextlib.suppress(Exception):
                context.__exit__(type(error), error, error.__traceback__)
            raise
        context.__exit__(None, None, None)
    finally:
        # torch.cuda.graph leaves its side stream current when capture_end raises.
        torch.cuda.set_stream(caller_stream)
    return output


def _discard(graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
    """Drop a failed capture so nothing of it stays registered; the original error wins."""
    with contextlib.suppress(Exception):
        graph.reset()
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)
