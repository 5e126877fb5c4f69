"""What one rank runs in an agreed step (`AgreedStep`), and the helpers the step agreement shares.

`StepAgreement` (`graphcap.distributed.step`) makes an `AgreedStep` per step; the manager runs it.
`counts_buffers` is the engine buffer of every DP rank's token count (`Parallel(token_counts=True)`);
`is_collective_error` tells a collective's error from the forward's own.
"""

from __future__ import annotations

import dataclasses

from graphcap.batch import IDLE, StepBatch
from graphcap.distributed.options import Parallel
from graphcap.errors import DistributedTimeoutError
from graphcap.inputs import BufferSpec
from graphcap.keys import Dispatch, GraphKey, KeyRegistry, Mode

__all__ = ["COUNTS_BUFFER", "AgreedStep", "counts_buffers", "eager_key", "is_collective_error"]

COUNTS_BUFFER = "num_tokens_across_dp"
"""The engine buffer of per-rank token counts (`Parallel(token_counts=True)`): int32 [DP world size]."""


def counts_buffers(parallel: Parallel) -> tuple[BufferSpec, ...]:
    """The engine buffer that holds every DP rank's token count, with `Parallel(token_counts=True)`."""
    if not parallel.token_counts:
        return ()
    import torch.distributed as dist

    return (BufferSpec(COUNTS_BUFFER, "none", shape=(dist.get_world_size(parallel.dp_group),), dtype="int32"),)


@dataclasses.dataclass
class AgreedStep:
    """What one rank runs in an agreed step."""

    number: int
    dispatch: Dispatch
    """The agreed mode and key: a captured key, or the eager key of `batch` (padded with `pad_eager`)."""
    batch: StepBatch
    """The rank's batch, or the empty batch when it joins the step idle."""
    counts: tuple[int, ...]
    """Every data-parallel rank's real token count (this rank's alone without a DP group)."""
    padded: tuple[int, int] | None
    """(tokens, requests) every rank's eager step pads to (`pad_eager`), else None."""
    refused: BaseException | None = None
    """Why this rank joined idle; raised once the step ran."""
    checked: bool = False
    """Whether the tensor-parallel ranks agreed that their staged rows passed (`StepAgreement.staged`)."""
    sampled: bool | None = None
    """Whether the step's replay is sampled (`StepAgreement.sampled`; None: not asked yet)."""

    def refuse(self, error: BaseException) -> tuple[StepBatch, Dispatch]:
        """Join the step idle after `error` (a refusal after the agreement); re-raise if already idle."""
        if self.batch is IDLE:
            raise error
        self.refused, self.batch = error, IDLE
        if self.dispatch.mode is Mode.EAGER:
            self.dispatch = self.dispatch._replace(key=eager_key(IDLE, self.padded, self.dispatch.key.axes))
        return self.batch, self.dispatch

    def raise_refusal(self) -> None:
        if self.refused is not None:
            raise self.refused


def eager_key(batch: StepBatch, padded: tuple[int, int] | None, axes: tuple[tuple[str, int], ...]) -> GraphKey:
    """The key of an eager step: the batch's own counts, or the counts every rank pads to, at axis values `axes`."""
    num_tokens, num_reqs = padded if padded is not None else (batch.num_tokens, batch.num_reqs)
    return KeyRegistry.eager_key(num_tokens, num_reqs, axes)


def is_collective_error(exc: BaseException) -> bool:
    """Whether `exc` comes from a collective (a torch.distributed error, or gloo's/NCCL's RuntimeError)."""
    if isinstance(exc, DistributedTimeoutError) or not isinstance(exc, RuntimeError):
        return False
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "c10d", "ProcessGroup"))
