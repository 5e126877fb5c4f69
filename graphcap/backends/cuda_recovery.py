"""After a failed CUDA capture: the error graphcap raises for it, and the CUDA generators out of capture mode.

What refuses a capture-illegal call, and what it says (texts of libcudart 13 and torch 2.11's own):

- CUDA, errors 900-907: a call the stream's capture cannot hold (900: a sync, `.item()`, a pageable
  copy torch did not stop), the capture invalidated by an earlier one (901), or the capture's stream
  graph broken (902 merge, 903 unmatched, 904 a side stream forked and not joined back, 905 a wait
  on uncaptured work, 906 the legacy stream made to depend on it, 907 an event of the capture used
  outside it). `capture_failure` turns them into a `CaptureError` naming the likely causes.
- torch itself, before CUDA sees it: a copy between a pageable CPU tensor and a CUDA tensor during
  capture ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor
  is pinned", `Copy.cu`). The capture is not invalidated by it; graphcap's error names the fix.

A capture CUDA invalidated leaves the CUDA generators in capture mode: `capture_begin` puts the
device's default generator and every registered one into it, and `capture_end` throws (at
`cudaStreamEndCapture`) before it takes them out. Every eager random draw then fails ("Offset
increment outside graph capture encountered unexpectedly") until a capture succeeds.
`restore_generators` runs that capture: an empty one, on the pool's side stream, with the
generators registered, into a pool of its own, then resets it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from graphcap.backends.generators import register_generators
from graphcap.errors import CaptureError

__all__ = ["COPY_REFUSED", "INVALIDATED", "capture_failure", "restore_generators"]

INVALIDATED = (
    "operation not permitted when stream is capturing",  # 900 cudaErrorStreamCaptureUnsupported
    "operation failed due to a previous error during capture",  # 901 cudaErrorStreamCaptureInvalidated
    "operation would result in a merge of separate capture sequences",  # 902 cudaErrorStreamCaptureMerge
    "capture was not ended in the same stream as it began",  # 903 cudaErrorStreamCaptureUnmatched
    "capturing stream has unjoined work",  # 904 cudaErrorStreamCaptureUnjoined: a fork not joined
    "dependency created on uncaptured work in another stream",  # 905 cudaErrorStreamCaptureIsolation
    "operation would make the legacy stream depend on a capturing blocking stream",  # 906 ...Implicit
    "operation not permitted on an event last recorded in a capturing stream",  # 907 cudaErrorCapturedEvent
)
"""The texts of CUDA's capture errors 900-907 (`cudaGetErrorString`)."""

COPY_REFUSED = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
"""torch's refusal of a pageable host-device copy during capture (torch 2.11 and later)."""

_CAUSES = (
    "common causes: a host sync (.item(), torch.cuda.synchronize(), nonzero) in a code path the first "
    "warmup did not take, a side stream forked and not joined back, another thread using CUDA during capture"
)


def capture_failure(name: str, error: BaseException) -> CaptureError | None:
    """The `CaptureError` for a capture of `name` that CUDA or torch refused with `error`; None for others."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if COPY_REFUSED in text:
        return CaptureError(
            f"torch refused a host-device copy during the capture of {name} ({first}): the forward copies "
            "between a pageable CPU tensor and a CUDA tensor, which a CUDA graph cannot hold. Stage the data "
            "in a persistent device buffer before the step (or copy from a pinned tensor, non_blocking=True); "
            "graphcap.backends.check_capture_safe(forward, device) names the line"
        )
    if any(marker in text for marker in INVALIDATED):
        return CaptureError(
            f"CUDA invalidated the capture of {name}: the forward called something a CUDA graph cannot hold "
            f"that the preflight did not name ({first}). Find it with "
            f"graphcap.backends.check_capture_safe(forward, device) or checks.sync_debug: true; {_CAUSES}"
        )
    return None


def restore_generators(
    device: torch.device, stream: torch.cuda.Stream, generators: Iterable[torch.Generator], capture_error_mode: str
) -> None:
    """Take the default CUDA generator of `device` and `generators` out of capture mode after a failed capture.

    An empty capture of them on `stream` (torch registers the default generator itself), into a pool
    of its own (the failed capture's pool may be released already), then reset. Raises what CUDA
    raises (a sticky error); the caller keeps its own error.
    """
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)
    with torch.cuda.device(device), torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty": it only ends the generators' capture
        register_generators(graph, generators)
        graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode=capture_error_mode)
        graph.capture_end()
    caller.wait_stream(stream)
    graph.reset()
