"""The CPU (gloo) group graphcap's agreement runs on, for a group an engine passes in.

The agreement is a few int64 on the host, so it runs on a gloo group even when the model's
own collectives use NCCL (vLLM keeps a `cpu_group` beside each device group for the same
reason). A group whose CPU backend is gloo is used as it is: pass the engine's CPU group and
graphcap creates nothing. For any other group a gloo twin over the same ranks is created
once per set of ranks, with `use_local_synchronization=True`: only the group's own ranks take
part, so under TP x DP each DP group makes its twin without the other groups' ranks (plain
`new_group` must be called by every rank of the world in the same order, and deadlocks when
each rank asks only for its own group).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

__all__ = ["cpu_group", "global_rank"]

_TWINS: dict[tuple[int, ...], Any] = {}
"""Ranks -> the gloo twin made for them (one per set of ranks: a second one would collide by name)."""


def cpu_group(group: Any, timeout: _dt.timedelta) -> Any:
    """`group` when its CPU backend is gloo, else its gloo twin (made once, by the group's ranks only)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if backend == "gloo" or "cpu:gloo" in backend:
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    twin = _TWINS.get(ranks)
    if twin is not None and _is_alive(twin):
        return twin
    twin = dist.new_group(list(ranks), timeout=timeout, backend="gloo", use_local_synchronization=True)
    _TWINS[ranks] = twin
    return twin


def global_rank(group: Any, group_rank: int) -> int:
    """The rank in the default (world) group of `group_rank` of `group`."""
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank


def _is_alive(group: Any) -> bool:
    """Whether `group` still belongs to the current world (not destroyed with an earlier one)."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (ValueError, KeyError, RuntimeError):
        return False
    return True
