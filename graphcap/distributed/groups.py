"""The gloo group graphcap's agreements run on: its own, over the ranks of a group an engine passes in.

The agreement is a few int64 on the host, so it runs on gloo even when the model's own
collectives use NCCL. It never runs on the engine's group itself, gloo or not: a rank whose
forward failed part-way reaches its next agreement while its peers are still inside the
model's collectives, and on a shared gloo group the two would pair (gloo aborts on the
mismatched sizes) instead of the agreement waiting for the peers. So for every group passed
in, graphcap makes a gloo twin over the same ranks, once per set of ranks (managers and
roles over the same ranks share it), with `use_local_synchronization=True`: only the group's
own ranks take part, so under TP x DP each DP group makes its twin without the other groups'
ranks (plain `new_group` must be called by every rank of the world in the same order, and
deadlocks when each rank asks only for its own group).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

__all__ = ["cpu_group", "global_rank"]

_TWINS: dict[tuple[int, ...], Any] = {}
"""Ranks -> the gloo twin made for them (one per set of ranks: a second one would collide by name)."""


def cpu_group(group: Any, timeout: _dt.timedelta) -> Any:
    """graphcap's own gloo group over the ranks of `group` (made once per set of ranks, by those ranks only)."""
    import torch.distributed as dist

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
