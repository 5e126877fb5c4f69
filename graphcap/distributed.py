"""The collective behind data-parallel agreement: a MAX all-reduce of a few ints per step.

Each rank's graph may hold collectives (expert parallelism, DP attention), so ranks that
pad differently would deadlock or corrupt them. `CaptureManager` therefore reduces, once
per step, the values every rank needs to derive the same key (its token and request
counts, whether it cannot use a graph, whether its batch is not uniform) and dispatches on
the reduced values. This module only moves the ints.

The reduction runs on a CPU (gloo) group even when the model's own collectives use NCCL,
as vLLM does: a host tensor in, a host tensor out, one round trip and no device sync, so
the host keeps running ahead of the GPU. Given an NCCL group, a gloo group over the same
ranks is made once (a collective call: every rank builds its manager at the same point).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphcap.batch import StepBatch
from graphcap.errors import ConfigError, ConfigProblem, DistributedTimeoutError
from graphcap.keys import Dispatch, KeyRegistry, Mode

__all__ = ["DataParallelSync"]

_MAX_VALUES = 8


class DataParallelSync:
    """MAX all-reduce of a few ints over a CPU group; `first_failed_rank` for lockstep capture."""

    def __init__(self, group: Any, timeout: float = 300.0) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group given, but torch.distributed is not initialized; call init_process_group first")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"dp_timeout must be > 0 seconds; got {timeout!r}")
        self._dist = dist
        self.timeout = _dt.timedelta(seconds=timeout)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        if self.backend != "gloo":
            ranks = dist.get_process_group_ranks(group)
            group = dist.new_group(ranks, timeout=self.timeout, backend="gloo")
        self.group = group
        self._values = torch.zeros(_MAX_VALUES, dtype=torch.int64)  # host tensor, reused every step
        self.step = 0

    def reduce_max(self, values: Sequence[int], what: str) -> list[int]:
        """The element-wise MAX of `values` over every rank (collective: every rank calls it)."""
        if len(values) > _MAX_VALUES:
            raise ValueError(f"reduce_max takes at most {_MAX_VALUES} values; got {len(values)}")
        self.step += 1
        buffer = self._values[: len(values)]
        for i, value in enumerate(values):
            buffer[i] = value
        self._all_reduce_max(buffer, f"step {self.step}: {what}")
        return buffer.tolist()

    def agree_on_dispatch(self, registry: KeyRegistry, batch: StepBatch, uniform: bool, own: Dispatch) -> Dispatch:
        """The dispatch every rank reaches from the reduced counts (collective: every rank calls it).

        All ranks replay one key or all run eagerly: the MAX of the token and request counts, of
        "cannot use a graph" and of "not uniform" decide. An idle rank (no requests) joins any key;
        a rank whose own step could not replay gives its own reason, the others `peer`.
        """
        cannot = own.mode is Mode.EAGER and not (batch.num_reqs == 0 and registry.mode != "none")
        num_tokens, any_cannot, any_mixed, num_reqs = self.reduce_max(
            [batch.num_tokens, int(cannot), int(not uniform), batch.num_reqs], "dispatch"
        )
        eager = Dispatch(
            Mode.EAGER,
            own.key if own.mode is Mode.EAGER else registry.eager_key(batch.num_tokens, batch.num_reqs),
            own.reason if own.mode is Mode.EAGER else "peer",
        )
        if any_cannot:
            return eager
        agreed = registry.dispatch(num_tokens, num_reqs, not any_mixed)
        return eager if agreed.mode is Mode.EAGER else agreed

    def first_failed_rank(self, failed: bool, what: str) -> int | None:
        """All-reduce a failure flag; the lowest failing rank, or None when all succeeded."""
        (value,) = self.reduce_max([self.world_size - self.rank if failed else 0], what)
        if not 0 <= value <= self.world_size:  # a peer answered another collective: out of step
            raise DistributedTimeoutError(
                f"step {self.step}: {what}: the ranks are out of step (a peer sent {value}, not a failure flag); "
                "every rank must run the same calls in the same order with the same config"
            )
        return None if value == 0 else self.world_size - value

    def agree_on_config(self, fingerprint: int, items: Mapping[str, str]) -> None:
        """Collective, before any other: every rank must hold the same config fingerprint.

        `fingerprint` is a non-negative int below 2**62 (`config.fingerprint.fingerprint_int`);
        one all-reduce of `[fp, -fp]` tells whether all are equal. When they are not, the ranks
        gather `items` (dotted key -> value) and raise `ConfigError` naming each differing key
        with every rank's value, instead of a misleading timeout or a capture failure later.
        """
        pair = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64)
        self._all_reduce_max(pair, "config agreement")
        highest, lowest = int(pair[0]), -int(pair[1])
        if highest == lowest:
            return
        gathered: list[Any] = [None] * self.world_size
        try:
            self._dist.all_gather_object(gathered, dict(items), group=self.group)
        except RuntimeError as exc:
            raise self._timeout_error("config agreement", str(exc)) from exc
        keys = sorted({key for values in gathered for key in values})
        problems = []
        for key in keys:
            values = [values.get(key, "<absent>") for values in gathered]
            if len(set(values)) > 1:
                per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
                problems.append(
                    ConfigProblem(
                        key,
                        f"differs across the {self.world_size} data-parallel ranks ({per_rank}); every rank "
                        "must load the same config (only device and report.path may differ)",
                    )
                )
        raise ConfigError(problems, f"the config of data-parallel rank {self.rank}")

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
