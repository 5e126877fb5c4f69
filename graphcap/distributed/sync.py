"""`GroupSync`: the one agreement reduction graphcap makes over a group, with the call it belongs to.

Each rank's graph may hold collectives (tensor parallelism, expert parallelism, DP attention),
so ranks must replay the same key, capture in lockstep and stage the same rows. Every
agreement graphcap needs (a step's dispatch, a capture pass starting, a key's failure, the
config) is one MAX all-reduce of a fixed-length int64 host tensor over a CPU (gloo) group:

    [ payload (8) | value of each rank (W) | call of each rank (W) | apart (1) ]

Each rank writes its payload, its own slot of the values and its own slot of the calls (zero
elsewhere), so one MAX gives every rank the element-wise maximum of the payloads (the
dispatch counts) and every rank's value (its token count, its staged-rows digest, its failure)
and call. A call is the step number, the kind of call and a 16-bit tag of its detail (a key):
ranks whose calls differ (one skipped a step, one captures while another steps) fail this very
reduction with "ranks out of step", naming every rank's call, instead of pairing it with
another one. Every agreement has the same length, so no two calls reduce tensors of different
lengths. `apart` carries "out of step" from one group's agreement into the next one of the same
call (a TP x DP grid agrees TP, then DP): a rank whose first agreement failed still joins the
second, flagged, so the ranks of the other group learn it there instead of waiting. One round
trip, no device sync: the host keeps running ahead of the GPU.
"""

from __future__ import annotations

import datetime as _dt
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from graphcap.distributed.groups import cpu_group, global_rank
from graphcap.errors import ConfigError, ConfigProblem, DistributedTimeoutError

__all__ = ["KINDS", "Agreement", "GroupSync", "call_tag", "call_word", "config_mismatch", "out_of_step"]

PAYLOAD = 8
KINDS = {
    "construction": (1, "construction (the config agreement)"),
    "capture": (2, "capture() starting"),
    "key": (3, "capturing"),
    "sticky": (4, "the sticky-error check of"),
    "dispatch": (5, "dispatch()"),
    "execute": (6, "execute()"),
    "reduce_max": (7, "reduce_max"),
    "release": (8, "release()"),
    "resize_kv": (9, "resize_kv()"),
    "reset": (10, "reset()"),
    "capture_pending": (11, "capture_pending() starting"),
    "staged": (12, "the staged-rows check of"),
    "budget": (13, "the memory-budget admission of"),
}
"""Kind of call -> (its number in the call slot, its name in "ranks out of step" messages)."""
_NAMES = {number: name for number, name in KINDS.values()}


class Agreement(NamedTuple):
    """What one agreement returns on every rank."""

    payload: list[int]
    """The element-wise MAX of every rank's payload."""
    values: list[int]
    """Each rank's value (index: the rank in the group)."""
    calls: tuple[int, ...] = ()
    """Each rank's call (agreements given `apart`)."""
    apart: bool = False
    """Whether the ranks made different calls, or one of them came flagged from an earlier agreement that did."""


def call_tag(detail: str) -> int:
    """A 16-bit tag of a call's detail (a key): ranks agreeing on different keys differ in it."""
    return zlib.crc32(detail.encode()) & 0xFFFF


def call_word(step: int, kind: str, detail: str = "") -> int:
    """A rank's call in the call slot: the step, the kind of call, the tag of its detail."""
    return (step << 24) | (KINDS[kind][0] << 16) | (call_tag(detail) if detail else 0)


class GroupSync:
    """The agreement reduction over one group (data- or tensor-parallel), bounded by `timeout` seconds.

    The reduction never runs on `group` itself: it runs on graphcap's own gloo group over the same
    ranks, made once, by those ranks only (`graphcap.distributed.groups`).
    `role` names the group in messages ("data-parallel", "tensor-parallel").
    """

    def __init__(self, group: Any, timeout: float = 300.0, role: str = "data-parallel") -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group given, but torch.distributed is not initialized; call init_process_group first")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (Parallel(timeout=...)); got {timeout!r}")
        self.role = role
        self.timeout = _dt.timedelta(seconds=timeout)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process (rank {dist.get_rank()}) is not a member of the {role} group it passed")
        self.world_size = dist.get_world_size(group)
        self.ranks = [global_rank(group, r) for r in range(self.world_size)]
        """The world rank of each rank of the group (messages name world ranks)."""
        self.group = cpu_group(group, self.timeout)
        """graphcap's own gloo group over the same ranks (a `ProcessGroupGloo`, `groups.cpu_group`)."""
        self._max = dist.AllreduceOptions()
        self._max.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        W = self.world_size
        self._buffer = torch.zeros(PAYLOAD + 2 * W + 1, dtype=torch.int64)  # host tensor, reused by every agreement
        self._values = self._buffer.numpy()  # the same memory: numpy writes cost less than tensor indexing

    def agree(
        self,
        step: int,
        kind: str,
        payload: Sequence[int] = (),
        value: int = 0,
        detail: str = "",
        *,
        apart: bool | None = None,
    ) -> Agreement:
        """The one reduction (collective: every rank of the group calls it with the same step, kind and detail).

        `step`: the step number (steps executed before it, for capture); `kind`: a key of
        `KINDS` ("execute", "dispatch", "capture", ...); `payload`: at most 8 ints >= 0, maxed;
        `value`: this rank's int >= 0 that every rank learns. `DistributedTimeoutError` when it
        does not complete within the timeout, or when the ranks made different calls. `apart`
        (a bool: lenient): whether this rank comes out of step from an earlier agreement of the call;
        the agreement then returns `Agreement.apart` and every call instead of raising.
        """
        if len(payload) > PAYLOAD:
            raise ValueError(f"an agreement carries at most {PAYLOAD} values; got {len(payload)}")
        W, buffer = self.world_size, self._values
        buffer.fill(0)
        buffer[: len(payload)] = payload
        call = call_word(step, kind, detail)
        buffer[PAYLOAD + self.rank] = value
        buffer[PAYLOAD + W + self.rank] = call
        buffer[PAYLOAD + 2 * W] = int(bool(apart))
        self._all_reduce_max(self._buffer, f"step {step}: {kind}{f' of {detail}' if detail else ''}")
        values = buffer.tolist()
        calls = values[PAYLOAD + W : PAYLOAD + 2 * W]
        differ = any(c != call for c in calls)
        if apart is not None:
            payload_max, each = values[: len(payload)], values[PAYLOAD : PAYLOAD + W]
            return Agreement(payload_max, each, tuple(calls), differ or values[-1] > 0)
        if differ:
            raise self._out_of_step(calls, f"step {step}: {kind}{f' of {detail}' if detail else ''}")
        return Agreement(values[: len(payload)], values[PAYLOAD : PAYLOAD + W])

    def reduce_max(self, values: Sequence[int], what: str, step: int = 0) -> list[int]:
        """The element-wise MAX of `values` (at most 8 ints >= 0) over every rank (collective)."""
        return self.agree(step, "reduce_max", values, detail=what).payload

    def first_failed(self, known: int | None, step: int, kind: str, detail: str) -> int | None:
        """The lowest world rank any rank of the group knows to have failed (`known`: this rank's), or None."""
        agreement = self.agree(step, kind, value=0 if known is None else known + 1, detail=detail)
        failed = [value - 1 for value in agreement.values if value]
        return min(failed) if failed else None

    def agree_on_config(self, fingerprint: int, items: Mapping[str, str]) -> None:
        """Collective, before any other: every rank must hold the same config fingerprint.

        `fingerprint` is a non-negative int below 2**62 (`config.fingerprint.fingerprint_int`,
        which covers the torch and graphcap versions too). When the ranks differ, they gather
        `items` (dotted key -> value) and raise `ConfigError` naming each differing key with
        every rank's value, instead of a misleading timeout or a capture failure later.
        `StepAgreement.agree_on_config` chains the same two steps over a DP and a TP group.
        """
        highest, complement, _ = self.fingerprint_range(fingerprint, 2**62 - fingerprint)
        if (highest, complement) == (fingerprint, 2**62 - fingerprint):
            return
        raise config_mismatch(self.gather({self.ranks[self.rank]: dict(items)}), self.role)

    def fingerprint_range(self, highest: int, complement: int, serial: int = 0) -> tuple[int, int, int]:
        """(the MAX of `highest`, the MAX of `complement`, the MAX of `serial`) over the group: `2**62 -
        complement` is the smallest fingerprint, so every rank holds the same one when the two meet; `serial`
        rides along (the ledger's name, `StepAgreement.agree_on_config`) (collective)."""
        highest, complement, serial = self.agree(0, "construction", [highest, complement, serial]).payload
        return highest, complement, serial

    def gather(self, known: dict[int, Any]) -> dict[int, Any]:
        """Every rank's `known` (world rank -> items, or a call), merged (collective; only after a mismatch)."""
        import pickle

        data = pickle.dumps(known)
        try:
            length = torch.tensor([len(data)], dtype=torch.int64)
            self._wait(self.group.allreduce([length], self._max), "config agreement")
            mine = torch.zeros(int(length.item()), dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            parts = [torch.empty_like(mine) for _ in range(self.world_size)]
            self._wait(self.group.allgather([parts], [mine]), "config agreement")
        except RuntimeError as exc:
            raise self._timeout_error("config agreement", str(exc)) from exc
        gathered = [pickle.loads(part.numpy().tobytes()) for part in parts]  # pickle ignores the zero tail
        return {rank: items for part in gathered for rank, items in part.items()}

    def _out_of_step(self, calls: list[int], what: str) -> DistributedTimeoutError:
        return out_of_step(dict(zip(self.ranks, calls)), what, self.role)

    def gather_calls(self, known: dict[int, int]) -> dict[int, int]:
        """Every rank's `known` calls (world rank -> call), merged (collective; only once ranks are out of step)."""
        return {rank: int(call) for rank, call in self.gather(known).items()}

    def _all_reduce_max(self, tensor: torch.Tensor, what: str) -> None:
        try:
            self._wait(self.group.allreduce([tensor], self._max), what)
        except RuntimeError as exc:  # gloo: "Operation timed out!"; a dead peer: connection closed
            raise self._timeout_error(what, str(exc)) from exc

    def _wait(self, work: Any, what: str) -> None:
        if work.wait(self.timeout) is False:  # backends that report a timeout instead of raising
            raise self._timeout_error(what, "timed out")

    def _timeout_error(self, what: str, cause: str) -> DistributedTimeoutError:
        first = cause.strip().splitlines()[0][:200] if cause.strip() else "no detail"
        return DistributedTimeoutError(
            f"{what}: the agreement across {self.world_size} {self.role} ranks failed or did not complete within "
            f"{self.timeout.total_seconds():g} s on rank {self.ranks[self.rank]} ({first}); every rank must call "
            "execute/dispatch once per step (an idle rank passes None) and capture the same keys; a rank that "
            "stopped stepping or died leaves the process group unusable: restart the ranks"
        )


def out_of_step(calls: Mapping[int, int], what: str, role: str) -> DistributedTimeoutError:
    """ "ranks out of step", naming the call of each rank of `calls` (world rank -> call)."""
    described = "; ".join(f"rank {rank}: {_describe(calls[rank])}" for rank in sorted(calls))
    return DistributedTimeoutError(
        f"{what}: ranks out of step: the {role} ranks made different calls ({described}); every rank must call "
        "execute/dispatch once per step (an idle rank passes None), and the same calls between steps (capture(), "
        "capture_pending(), release(), resize_kv(), reset()) at the same point, with the same config. "
        "No rank ran the step"
    )


def config_mismatch(known: Mapping[int, Mapping[str, str]], role: str) -> ConfigError:
    """The `ConfigError` naming each key whose value differs between the ranks of `known` (world rank -> items)."""
    ranks = sorted(known)
    problems = []
    for key in sorted({key for items in known.values() for key in items}):
        values = [known[rank].get(key, "<absent>") for rank in ranks]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in zip(ranks, values))
            if key.startswith("version."):
                must = "every rank must run the same torch and graphcap"
            elif key.startswith("Parallel."):
                must = f"every rank must pass the same Parallel({key.partition('.')[2]}=...)"
            else:
                must = "every rank must load the same config (only device and report.path may differ)"
            problems.append(ConfigProblem(key, f"differs across the {len(ranks)} {role} ranks ({per_rank}); {must}"))
    return ConfigError(problems, f"the config of the {len(ranks)} {role} ranks")


def _describe(call: int) -> str:
    """A call as its rank made it: "execute() of step 3", "capturing a key after step 2"."""
    step, kind = call >> 24, (call >> 16) & 0xFF
    name = _NAMES.get(kind, "an unknown call")
    if kind in (3, 4, 13):
        return f"{name} a key (tag {call & 0xFFFF}) after step {step}"
    if kind in (1, 2, 8, 9, 10, 11):  # between steps: the number is the steps executed before it
        return f"{name} after step {step}"
    return f"{name} of step {step}"
