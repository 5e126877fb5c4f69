"""`Parallel`: the data- and tensor-parallel options of one `CaptureManager`, in one object.

    manager = CaptureManager(model, config, parallel=Parallel(dp_group=dp, tp_group=tp, timeout=60.0))

`group=` stays on `CaptureManager` as the shorthand for `Parallel(dp_group=group)` (the common
case: data parallel only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AGREED", "Parallel", "agreed_options", "parallel_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallel:
    """Who a manager's peers are and how it agrees with them; every field has a default (no peers).

    Checked when built: `TypeError`/`ValueError` naming the field and the value.
    """

    dp_group: Any = None
    """The data-parallel group: ranks that serve different requests and must replay the same key each step
    (a `torch.distributed` group; its gloo CPU group when the engine has one). None: no DP peers."""
    tp_group: Any = None
    """The tensor-parallel group: ranks that shard one model and must execute the same batch each step."""
    timeout: float = 300.0
    """Seconds any agreement with peers may wait (a step, a capture, a lifecycle call); then
    `DistributedTimeoutError` on the waiting rank."""
    failure_timeout: float = 30.0
    """Seconds a rank whose capture forward (a warmup, the recording, a verification) failed part-way keeps
    issuing, with placeholder tensors, the collectives its peers publish, until every peer has finished the
    key's forwards (`graphcap.distributed.ledger`); then it reports its failure in the key's agreement. Past
    it, the rank stops following and its peers stay in their collective until their process group's timeout."""
    pad_eager: bool | None = None
    """Whether an eager step pads to the largest token and request counts of the DP ranks, so an eager
    forward's collectives have one shape everywhere. None (the default): pad once a captured graph of this
    manager holds a collective (graphcap records them), else run each rank's own count; True/False: always/never."""
    token_counts: bool = False
    """Stage every DP rank's real token count into `inputs.extras["num_tokens_across_dp"]` (int32 [DP ranks])."""

    def __post_init__(self) -> None:
        for name in ("timeout", "failure_timeout"):
            seconds = getattr(self, name)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
                raise ValueError(f"Parallel({name}=...) must be a finite number of seconds > 0; got {seconds!r}")
        if self.pad_eager is not None and not isinstance(self.pad_eager, bool):
            raise TypeError(f"Parallel(pad_eager=...) must be None, True or False; got {self.pad_eager!r}")
        if not isinstance(self.token_counts, bool):
            raise TypeError(f"Parallel(token_counts=...) must be True or False; got {self.token_counts!r}")
        if self.dp_group is None and (self.pad_eager or self.token_counts):
            raise ValueError(
                "Parallel(pad_eager=True) and Parallel(token_counts=True) need a data-parallel group: "
                "pass Parallel(dp_group=...)"
            )

    @property
    def has_peers(self) -> bool:
        """Whether any group is given (no group: the manager agrees with nobody)."""
        return self.dp_group is not None or self.tp_group is not None


AGREED = ("pad_eager", "token_counts")
"""The fields every rank of a manager's groups must set alike (they decide the shapes of a step's collectives);
agreed at construction with the config (`agreed_options`)."""


def agreed_options(parallel: Parallel) -> dict[str, str]:
    """`Parallel.NAME` -> the value of each field of `AGREED`, as the construction agreement compares them."""
    return {f"Parallel.{name}": repr(getattr(parallel, name)) for name in AGREED}


def parallel_of(parallel: Parallel | None, group: Any) -> Parallel:
    """The options of a manager from `parallel=` and the `group=` shorthand (`Parallel(dp_group=group)`)."""
    if parallel is not None and not isinstance(parallel, Parallel):
        raise TypeError(f"parallel must be a graphcap.Parallel; got {type(parallel).__name__}")
    if group is None:
        return parallel or Parallel()
    if parallel is not None:
        raise TypeError(
            "CaptureManager got both group= and parallel=: group=g is the shorthand for "
            "parallel=Parallel(dp_group=g); pass the group inside Parallel(dp_group=...) only"
        )
    return Parallel(dp_group=group)
