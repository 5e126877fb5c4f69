"""`CollectiveLedger`: a capture forward that fails part-way still issues the collectives its peers wait in.

A rank whose forward raises before one of its collectives (during a key's warmups, recording or
verification) leaves its peers blocked in that collective: on gloo until the process group's
timeout, and aborting a group on one side does not wake the other. graphcap knows what the
forward issues: the first forward of each shape that completes leaves its sequence of functional
collectives here (op, group, shapes and dtypes, in order). When a later forward of the same shape
fails, the ledger issues the collectives it had not reached yet, with zero tensors of the recorded
shapes, so every peer completes its forward; the failure then goes to the key's agreement
(`FailurePolicy.settle`), and every rank skips the key or raises, naming the failing rank.

Covers the functional collectives (`torch.ops._c10d_functional.*`, which the emulated backend
records and `torch.distributed._functional_collectives` calls); a forward that fails in the first
run of its shape (the first warmup of a key) has no sequence yet, and its peers wait in the
collective until the process group's timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphcap.distributed.step import is_collective_error
from graphcap.phases import phase

__all__ = ["CollectiveLedger"]


log = logging.getLogger("graphcap")

_CAPTURE_PHASES = ("warmup", "capture", "verify")  # the keys of graphcap.capture.failures.PHASES


class _Call:
    """One collective as a forward issued it: the op, its arguments with each tensor as (shape, dtype, device)."""

    __slots__ = ("args", "op")

    def __init__(self, op: Any, args: tuple) -> None:
        self.op = op
        self.args = tuple(
            ("tensor", tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", a) for a in args
        )

    def issue(self) -> None:
        """Issue the collective again with zero tensors of the recorded shapes, and wait for it."""
        args = [torch.zeros(a[1], dtype=a[2], device=a[3]) if a[0] == "tensor" else a[1] for a in self.args]
        out = self.op(*args)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            torch.ops._c10d_functional.wait_tensor(tensor)


class _Watch(TorchDispatchMode):
    """Logs each functional collective the forward issues (never `wait_tensor`), in order."""

    def __init__(self, calls: list[_Call]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.name()
        if name.startswith("_c10d_functional::") and not name.endswith("wait_tensor") and not kwargs:
            self.calls.append(_Call(func, args))
        return func(*args, **(kwargs or {}))


class CollectiveLedger:
    """The collective sequence of each staged shape a capture forward ran, and the completion of a failed one."""

    def __init__(self) -> None:
        self.sequences: dict[Any, list[_Call]] = {}
        """(tokens, requests, phase kind) -> the collectives the first completed forward of it issued."""
        self.completed = 0
        """Forwards this ledger completed for peers after a failure (what tests and logs read)."""

    def wrap(self, forward: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`forward`, watched in capture phases (warmup, recording, verification); other phases run it as it is."""

        def watched(inputs: Any) -> Any:
            if phase() not in _CAPTURE_PHASES:
                return forward(inputs)
            shape = (int(inputs.num_tokens), int(inputs.num_reqs), inputs.key)
            calls: list[_Call] = []
            try:
                with _Watch(calls):
                    output = forward(inputs)
            except Exception as exc:
                exc.graphcap_phase = phase()  # type: ignore[attr-defined]  # failures.phase_of: named to every rank
                if not is_collective_error(exc):  # a collective that failed itself: the group is gone
                    self._complete(shape, len(calls))
                raise
            self.sequences.setdefault(shape, calls)
            return output

        return watched

    def _complete(self, shape: Any, issued: int) -> None:
        """Issue what the failed forward had not reached of the sequence its shape is known to issue."""
        known = self.sequences.get(shape)
        if not known or issued >= len(known):
            return
        log.warning("a capture forward failed after %d of its %d collectives: issuing the rest", issued, len(known))
        try:
            for call in known[issued:]:
                call.issue()
        except Exception as exc:  # the forward's own failure is what the rank reports
            log.warning("completing the failed forward's collectives failed too: %s", exc)
            return
        self.completed += 1
