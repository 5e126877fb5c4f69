"""Data-parallel agreement: every rank replays the same key in a step, or every rank runs eagerly.

Each rank's graph may hold collectives (expert parallelism, DP attention), so ranks that
pad differently would deadlock or corrupt them. One all-reduce (MAX) of a small int tensor
per step carries: the padded token count, whether this rank cannot use a graph (MIN of
"can" is MAX of "cannot"), whether this rank's batch is not uniform, and its request count.
Every rank then derives the same key from the same reduced values, so the decision is
symmetric by construction. A timeout surfaces as an error naming the step.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import torch

from graphcap.backends import CaptureError
from graphcap.batch import GraphKey, StepBatch

__all__ = ["DataParallelSync", "DistributedTimeoutError"]


class DistributedTimeoutError(CaptureError):
    """A collective did not complete in time: some rank stopped stepping (or died)."""


class DataParallelSync:
    """Per-step agreement over a `torch.distributed` process group (gloo on CPU, NCCL on GPUs)."""

    def __init__(self, group: Any, timeout: float = 300.0) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group given, but torch.distributed is not initialized; call init_process_group first")
        if not timeout > 0:
            raise ValueError(f"dp_timeout must be > 0 seconds; got {timeout!r}")
        self._dist = dist
        self.group = group
        self.timeout = _dt.timedelta(seconds=timeout)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        # NCCL reduces device tensors; gloo reduces host tensors.
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.step = 0

    def agree(self, registry, batch: StepBatch, key: GraphKey | None, reason: str) -> tuple[GraphKey | None, str]:
        """The key every rank uses this step (or None for all), given this rank's own choice.

        Collective: every rank of the group must call it once per step, an idle rank with an
        empty batch (it joins any key: its rows are all padding). `reason` is this rank's own
        eager reason; a rank that could have used a graph but runs eagerly because of a peer
        gets "peer". Requires equal captured keys on every rank (lockstep capture).
        """
        self.step += 1
        size = registry.sizes.pad(batch.num_tokens)
        cannot = 1 if key is None else 0
        not_uniform = 0 if key is not None and key.uniform else 1
        if batch.num_reqs == 0 and size is not None and registry.mode != "none":
            cannot, not_uniform = 0, 0  # an idle rank can join any key
        # [padded tokens, cannot use a graph, not uniform, requests], reduced with MAX
        packed = torch.tensor(
            [size if size is not None else 0, cannot, not_uniform, batch.num_reqs],
            dtype=torch.int64,
            device=self._device,
        )
        self._all_reduce_max(packed, f"step {self.step}: dispatch")
        agreed_size, any_cannot, any_not_uniform, max_num_reqs = (int(v) for v in packed.tolist())
        own_reason = reason if key is None else "peer"
        if any_cannot:
            return None, own_reason
        agreed = registry.captured_key(agreed_size, uniform=not any_not_uniform)
        # Only reduced values decide here (and the captured sets, equal after lockstep
        # capture), so every rank takes the same branch.
        if agreed is None or max_num_reqs > agreed.num_reqs:
            return None, own_reason
        return agreed, ""

    def first_failed_rank(self, failed: bool, what: str) -> int | None:
        """All-reduce a failure flag; the lowest failing rank, or None when all succeeded."""
        flag = torch.tensor([self.world_size - self.rank if failed else 0], dtype=torch.int64, device=self._device)
        self._all_reduce_max(flag, what)
        value = int(flag.item())
        return None if value == 0 else self.world_size - value

    def _all_reduce_max(self, tensor: torch.Tensor, what: str) -> None:
        try:
            work = self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
            completed = work.wait(self.timeout)
        except RuntimeError as exc:  # gloo: "Operation timed out!"; a dead peer: connection closed
            raise self._timeout_error(what, str(exc)) from exc
        if completed is False:  # backends that report a timeout instead of raising
            raise self._timeout_error(what, "timed out")

    def _timeout_error(self, what: str, cause: str) -> DistributedTimeoutError:
        first = cause.strip().splitlines()[0][:200] if cause.strip() else "no detail"
        return DistributedTimeoutError(
            f"{what}: the all-reduce across {self.world_size} ranks failed or did not complete within "
            f"{self.timeout.total_seconds():g} s on rank {self.rank} ({first}); every rank must call "
            "execute/dispatch once per step (an idle rank passes None) and capture the same keys; "
            "a rank that stopped stepping or died leaves the process group unusable: restart the ranks"
        )
