"""What a failed key does to a capture pass, and how a failure is described.

`FailurePolicy.settle` decides: data- and tensor-parallel ranks agree on it first (capture runs in
lockstep), a sticky CUDA error ends the pass on every rank, `capture.on_error: raise` raises
with the key and a hint, `skip` returns the reason the key is recorded with. Every failure's
frames are dropped first, so its tensors never outlive the key.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from graphcap.backends import CapturedGraph, is_sticky_cuda_error
from graphcap.errors import CaptureError, CaptureUnsafeError, ReplayMismatchError

if TYPE_CHECKING:  # distributed/ sits beside capture/; only the annotation needs it
    from graphcap.distributed.step import StepAgreement

__all__ = [
    "OOM_HINT",
    "PHASES",
    "STICKY_HINT",
    "FailurePolicy",
    "describe_failure",
    "failed_in",
    "failing_in",
    "phase_of",
]

PHASES = {"warmup": (1, "warmup"), "capture": (2, "recording"), "verify": (3, "verification")}
"""A capture phase -> (its code in the failure agreement, its name in messages)."""


def phase_of(failure: BaseException | None) -> str | None:
    """The capture phase a failed forward ran in ("warmup", "capture", "verify"), where graphcap saw it
    (`graphcap.distributed.ledger` marks the failures of the capture forwards)."""
    return getattr(failure, "graphcap_phase", None)


@contextmanager
def failing_in(run: str, batch: str | None = None) -> Iterator[None]:
    """An exception raised inside is marked with the run it failed in (`run`: "a warmup run", "the recording",
    "the verification replay", ...) and the batch it ran (`batch`: "a probe batch of 4 tokens and 4 requests"),
    each only where an inner `failing_in` did not say it first (`failed_in` reads them)."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, "graphcap_run", None) is None:
            exc.graphcap_run = run  # type: ignore[attr-defined]
        if batch is not None and getattr(exc, "graphcap_batch", None) is None:
            exc.graphcap_batch = batch  # type: ignore[attr-defined]
        raise


def failed_in(failure: BaseException) -> str | None:
    """Where `failing_in` saw `failure`: "the eager reference run of a probe batch of 4 tokens and 4 requests";
    None where no `failing_in` did, or for a replay that differed from eager (its message says where)."""
    run, batch = getattr(failure, "graphcap_run", None), getattr(failure, "graphcap_batch", None)
    if run is None or isinstance(failure, ReplayMismatchError):
        return None
    return f"{run} of {batch}" if batch is not None else run


log = logging.getLogger("graphcap")

OOM_HINT = (
    "the GPU ran out of memory while capturing; capture fewer sizes (capture.sizes), "
    "lower capture.max_size, or set capture.on_error: skip to run this size eagerly"
)
STICKY_HINT = (
    "this CUDA error is sticky: the CUDA context of this process is unusable (every later kernel, eager "
    "ones too, fails with it), so the pass stops here; restart the process. CUDA reports kernel errors "
    "late, so the faulty kernel may belong to an earlier key or step: rerun with CUDA_LAUNCH_BLOCKING=1 "
    "to locate it; a device-side assert in an indexing kernel usually means out-of-range metadata "
    "(run with checks.invariants: full)"
)


class FailurePolicy:
    """What a failed key does to a capture pass (`capture.on_error`), agreed with data- and tensor-parallel peers.

    `peers`: the manager's `StepAgreement` (its DP and TP groups), or None. Every rank calls
    `settle` for every key (failed or not) in the same order: it is a collective with peers.
    """

    def __init__(
        self, on_error: str, peers: StepAgreement | None = None, context: str = "", index_hint: str | None = None
    ) -> None:
        self.on_error = on_error
        self.peers = peers
        self.context = context
        """What the engine runs around a pass ("capture_context", "communicators", both, or ""): named when a
        verification of a forward that holds collectives fails."""
        self.index_hint = index_hint
        """Added to a failure that indexed out of range (an embedding given token ids past its vocabulary)."""

    def settle(self, what: str, failure: BaseException | None, graph: CapturedGraph | None = None) -> str | None:
        """None when `what` (a key, or its verification) succeeded on every rank; else release `graph`
        and raise (`on_error: raise`, or a sticky CUDA error) or return the reason to skip it."""
        failure = self._agree(what, failure)
        sticky = failure is not None and is_sticky_cuda_error(failure)
        if self.peers is not None:  # a rank that stops must not leave its peers waiting in the next key
            sticky_rank = self.peers.first_failed(sticky, "sticky", what)
            if sticky_rank is not None and not sticky:
                failure = CaptureError(
                    f"rank {sticky_rank} hit a sticky CUDA error (its own error names it); every rank stops the pass"
                )
                sticky = True
        if failure is None:
            return None
        where, run = PHASES.get(phase_of(failure) or "", (0, ""))[1], failed_in(failure)
        reason = describe_failure(failure) + (f" (in its {where} on this rank)" if where else "")
        reason += f"; it failed in {run}" if run is not None else ""
        reason += self._collectives_hint(failure, graph)  # before the release
        if self.index_hint is not None and isinstance(failure, IndexError) and "out of range" in str(failure):
            reason = f"{reason}; {self.index_hint}"
        if graph is not None:
            graph.release()
        _drop_frames(failure)  # the failed forward's tensors must not outlive this key
        if sticky:
            raise CaptureError(f"{what} failed: {reason}; {STICKY_HINT}") from failure
        if self.on_error == "raise":
            if isinstance(failure, CaptureUnsafeError):
                # Keep the type engines catch; the message already names op and line.
                failure.args = (f"{what} failed: {failure}",)
                raise failure
            raise CaptureError(f"{what} failed: {reason}") from failure
        log.warning("skipping %s: %s", what, reason)
        return reason

    def _collectives_hint(self, failure: BaseException, graph: CapturedGraph | None) -> str:
        """Why a replay can differ from eager when the forward holds collectives (a placeholder outside recording)."""
        from graphcap.communicators import holds_collectives

        if not isinstance(failure, ReplayMismatchError) or graph is None:
            return ""
        holds = holds_collectives([graph], ())
        if not holds and not self.context:
            return ""
        what = " holds collectives" if holds else ""
        inside = f"{' and' if holds else ''} ran inside {self.context}" if self.context else ""
        return (
            f". The forward{what}{inside}: a communicator or capture mode that returns a placeholder when no graph "
            "records (torch.cuda.is_current_stream_capturing() is False in warmups, verification and eager steps) "
            "makes them differ from the replay. An engine must not wrap capture() in its own capture mode: give it "
            "as capture_context= or a graphcap.Communicator, and let its collectives ask graphcap.is_capturing()"
        )

    def _agree(self, what: str, failure: BaseException | None) -> BaseException | None:
        if self.peers is None:
            return failure
        # A mismatch may follow from a peer's failure (its forward failed part-way and issued placeholders).
        derived = isinstance(failure, ReplayMismatchError)
        code = PHASES.get(phase_of(failure) or "", (0, ""))[0]
        first = self.peers.first_failure(failure is not None, "key", what, derived=derived, phase=code)
        if first is None:
            return failure
        failed_rank, first_derived, first_phase = first
        if failed_rank != self.peers.rank and (failure is None or (derived and not first_derived)):
            # Capture is in lockstep: a key one rank lacks is dropped by every rank (or raises).
            where = next((f" in its {name}" for c, name in PHASES.values() if c == first_phase), "")
            then = "; this rank's verification failed after it" if failure is not None else ""
            return CaptureError(
                f"rank {failed_rank} failed to capture it{where}; parallel ranks keep the same keys{then}"
            )
        return failure


def describe_failure(exc: BaseException) -> str:
    """One line: the exception's type and first line, or an out-of-memory hint."""
    text = (str(exc).strip().splitlines() or [""])[0]  # an exception may have no message
    # An OOM inside cudaGraphInstantiate surfaces as "CUDA error: out of memory", not OutOfMemoryError.
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA error: out of memory" in text:
        return f"out of memory ({text[:160] or 'no message'}); {OOM_HINT}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _drop_frames(exc: BaseException) -> None:
    """Free what the frames of a failed capture hold (its tensors live in the graph pool).

    The failure references its traceback, whose frames reference the failure again (a cycle)
    and every tensor of the failed forward; GC is off for the pass, so without this they would
    pin the pool until the pass ends. Frames keep their file and line for the traceback; only
    their locals go. A collection of the youngest generation then frees any other cycle the
    forward left: GC is off since the pass (or the lazy key) began, so everything it made is
    young, and the engine's old heap is not walked.
    """
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]
    gc.collect(0)
