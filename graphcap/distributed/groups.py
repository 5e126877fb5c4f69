"""The gloo group graphcap's agreements run on: its own, over the ranks of a group an engine passes in.

The agreement is a few int64 on the host, so it runs on gloo even when the model's own
collectives use NCCL. It never runs on the engine's group itself, gloo or not: a rank whose
forward failed part-way reaches its next agreement while its peers are still inside the
model's collectives, and on a shared gloo group the two would pair (gloo aborts on the
mismatched sizes) instead of the agreement waiting for the peers. So for every group passed
in, graphcap makes a gloo twin over the same ranks, once per set of ranks and world (managers
and roles over the same ranks share it), by those ranks only.

The twin is a `ProcessGroupGloo` on a prefix of the default store named by what every member
agrees on: the group's world ranks and how many twins this process made over those ranks
(`graphcap/gloo/0_1/0/`). Not `new_group`: its name counts every group the process made, so a
group made on one rank only (a manager's twin a draft model makes on its own rank) gives the
next twin of the members different names, and their rendezvous in the store never meets.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

__all__ = ["cpu_group", "global_rank", "twin_name"]

_TWINS: dict[tuple[int, ...], tuple[Any, Any]] = {}
"""World ranks -> (the default group it was made under, the gloo twin): one per set of ranks and world."""
_MADE: dict[tuple[int, ...], int] = {}
"""World ranks -> twins this process made over them (every member makes the same ones, in the same order)."""


def twin_name(ranks: tuple[int, ...], count: int) -> str:
    """The store prefix of the `count`-th twin over world `ranks`: the same on every member."""
    return f"graphcap/gloo/{'_'.join(map(str, ranks))}/{count}/"


def cpu_group(group: Any, timeout: _dt.timedelta) -> Any:
    """graphcap's own gloo group over the ranks of `group` (made once per set of ranks, by those ranks only)."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    world = dist.distributed_c10d._get_default_group()
    made = _TWINS.get(ranks)
    if made is not None and made[0] is world:
        return made[1]
    count = _MADE.get(ranks, 0)
    _MADE[ranks] = count + 1
    store = dist.PrefixStore(twin_name(ranks, count), dist.distributed_c10d._get_default_store())
    twin = dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), len(ranks), timeout)
    _TWINS[ranks] = (world, twin)
    return twin


def global_rank(group: Any, group_rank: int) -> int:
    """The rank in the default (world) group of `group_rank` of `group`."""
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank
