"""`CollectiveLedger`: a rank whose capture forward fails part-way still issues the collectives its peers wait in.

A rank whose forward raises before one of its collectives (in a key's warmups, its recording
or its verification) leaves its peers blocked in that collective: on gloo until the process
group's timeout, and aborting a group on one side does not wake the other. So, with peers,
each key's capture and each key's verification is a *segment*: from its first staging to its
agreement (`FailurePolicy.settle`). Inside a segment every rank publishes, before issuing each
functional collective (a forward's through a dispatch mode around it, `wrap`; a replay's through
the emulated tape's `backends.collectives.observed` calls), its descriptor (op, the group's
ranks, each tensor's shape and dtype, the other arguments) to its own stream in the default
process group's store (entry k of a rank at `graphcap/ledger/<ledger>/<rank>/<k>`, stamped with
the segment's number, the key reused by every segment: no entry is ever deleted, so the store
holds at most the longest segment's entries per rank), and closes the stream when it leaves
the segment ("end", or "fail" when it raised). A rank whose segment raised (not in a collective:
then the group is gone) reads its partners' streams (the ranks of the manager's DP and TP
groups) from the index of the collective it did not reach, and issues each collective that
names it with zero tensors of the published shapes, until every partner has closed its
stream; every partner then completes its forwards (and its verification sees the zeros), and
the key's agreement tells every rank which rank failed, in which phase. Each partner's stream
is read at the same index (every rank runs the same sequence of collectives), so the
collective the failing rank issues at index k is the one its peers issue at k.

Bounded: the failing rank follows for at most `Parallel.failure_timeout` seconds, then logs why
and stops (its peers then wait until their group's timeout); a placeholder collective it issued
waits at most its group's timeout, as the peers' own. An entry an earlier segment left
is read again until the partner overwrites it (or closes its stream before it): no partner
passes a key's agreement before every rank has entered it, so no rank runs a segment ahead.

Covers the functional collectives (`torch.ops._c10d_functional.*`, which the emulated backend
records and `torch.distributed._functional_collectives` calls) on groups whose other ranks are
among the manager's DP and TP ranks. Not covered (the peers wait until the process group's
timeout): collectives that are not functional (a custom all-reduce's own kernels, a
`Communicator`'s), `all_to_all_single` with per-rank split sizes (the failing rank cannot know
its own), a collective inside a piecewise key's eager op while a replay runs it (neither on the
tape nor in a watched forward), a failure in `capture.min_speedup`'s timing runs (outside any
segment), and the CUDA
backend (the manager makes no ledger there: its dispatch mode around the warmups would change
what torch.compile traces).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphcap.backends.collectives import observing
from graphcap.distributed.agreed import is_collective_error
from graphcap.phases import phase

__all__ = ["CollectiveLedger"]

log = logging.getLogger("graphcap")

_CAPTURE_PHASES = ("warmup", "capture", "verify")  # the keys of graphcap.capture.failures.PHASES
_NAMESPACE = "_c10d_functional::"
_SERIALS = itertools.count()
"""Ledgers made in this process without a `serial` (standalone ones); a manager's ledger takes the serial its
ranks agreed at construction (`StepAgreement.ledger`), the same on every partner whatever other managers
each rank made."""


class _Unfollowable(Exception):
    """What the failing rank cannot complete for its peers (the message says why)."""


class _Publish(TorchDispatchMode):
    """Publishes each functional collective (never `wait_tensor`) before it is issued."""

    def __init__(self, ledger: CollectiveLedger) -> None:
        super().__init__()
        self.ledger = ledger

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # As `backends.preflight.UnsafeOpMode`: no dynamo-disabling wrapper around the handler (microseconds on
        # every op of a watched forward); the handler compiles nothing.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.name()
        if name.startswith(_NAMESPACE) and not name.endswith("wait_tensor"):
            self.ledger.publish(func, args, kwargs)
        return func(*args, **kwargs)


class CollectiveLedger:
    """The segments of one manager's capture passes with peers (see the module doc).

    `rank`: this world rank; `partners`: the world ranks of its DP and TP groups; `timeout`:
    `Parallel.failure_timeout`; `device`: where placeholder tensors are made; `store`: the store
    the streams live in (default: the default process group's); `serial`: the ledger's name in the store,
    the same on every partner (a manager's: agreed at construction; None: this process's next own one).
    """

    def __init__(
        self,
        rank: int,
        partners: Sequence[int],
        timeout: float,
        device: Any,
        store: Any | None = None,
        serial: int | None = None,
    ) -> None:
        import torch.distributed as dist

        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self.rank = rank
        self.partners = tuple(sorted(set(partners) - {rank}))
        self.timeout = timeout
        self.device = torch.device(device)
        self._store_prefix = f"graphcap/ledger/{f'x{next(_SERIALS)}' if serial is None else serial}"
        self._store = dist.PrefixStore(self._store_prefix, store)
        self._segment = 0
        self._open = False
        self._issued = 0
        self._groups: dict[str, list[int]] = {}
        self._bodies: dict[tuple, bytes] = {}
        self.published = 0
        """Descriptors this rank published (what the cost benchmark counts)."""
        self.completed = 0
        """Failed segments after which this rank issued its peers' remaining collectives (tests and logs read it)."""
        self.placeholders = 0
        """Collectives this rank issued with placeholder tensors for its peers."""

    def wrap(self, forward: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`forward`, publishing its collectives inside a segment; its failure in a capture phase names that phase
        (`failures.phase_of`: told to every rank)."""

        def marked(inputs: Any) -> Any:
            try:
                with _Publish(self) if self._open else contextlib.nullcontext():
                    return forward(inputs)
            except Exception as exc:
                if phase() in _CAPTURE_PHASES and getattr(exc, "graphcap_phase", None) is None:
                    exc.graphcap_phase = phase()  # type: ignore[attr-defined]
                raise

        return marked

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        """One key's capture, or one key's verification, up to its agreement: every functional collective is
        published; when the body raises (not in a collective), this rank issues what its partners still issue
        (bounded by `timeout`), then the exception propagates to the key's agreement."""
        number = self._segment
        self._segment += 1
        self._issued = 0
        self._open = True
        try:
            with observing(self.publish):  # the tapes verification replays; forwards publish in `wrap`
                yield
        except Exception as exc:
            self._open = False
            self._close(number, "fail")
            if not is_collective_error(exc):  # a collective that failed itself: the group is gone
                self._follow(number)
            raise
        finally:
            self._open = False
        self._close(number, "end")

    def publish(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Set the descriptor of a collective this rank is about to issue as the next entry of its stream."""
        signature = (func, _signature(args), _signature(kwargs))
        body = self._bodies.get(signature)
        if body is None:  # the same op on the same shapes: encoded once
            entry = {
                "op": func.name()[len(_NAMESPACE) :],
                "overload": func._overloadname,
                "args": _encode(list(args)),
                "kwargs": _encode(kwargs),
                "ranks": self._ranks_of(func, args, kwargs),
            }
            body = self._bodies[signature] = _line(entry)[1:]
        self._store.set(f"{self.rank}/{self._issued}", b'{"segment":%d,' % (self._segment - 1) + body)  # type: ignore[arg-type]  # torch stubs: str; Store.set takes bytes
        self._issued += 1
        self.published += 1

    def _close(self, number: int, how: str) -> None:
        try:
            self._store.set(f"{self.rank}/{self._issued}", _line({"segment": number, "end": how}))  # type: ignore[arg-type]  # torch stubs: str; Store.set takes bytes
        except Exception as exc:  # the store is gone: the key's own failure (or agreement) reports it
            log.warning("could not close this rank's collective stream of a capture segment: %s", exc)

    def _follow(self, number: int) -> None:
        """Issue, with placeholder tensors, each collective naming this rank that its partners publish from the
        index this rank did not reach, until every partner closed its stream (or `timeout` passes)."""
        deadline = time.monotonic() + self.timeout
        streams = {partner: _Stream(self._store, str(partner), number) for partner in self.partners}
        index, issued = self._issued, 0
        try:
            while streams:
                wanted = None
                for partner in list(streams):
                    entry = streams[partner].at(index, deadline)
                    if entry is None:  # the partner left the segment (done, or failed itself) before it
                        del streams[partner]
                    elif wanted is None and self.rank in entry["ranks"]:
                        wanted = entry
                if wanted is None:
                    if streams:
                        raise _Unfollowable(
                            f"the partners' collective {index} does not name rank {self.rank}: its group holds ranks "
                            "outside the manager's data- and tensor-parallel groups"
                        )
                    break
                self._issue(wanted)
                index, issued = index + 1, issued + 1
        except Exception as exc:  # the rank's own failure is what it reports; its peers then wait in their group
            log.warning(
                "a capture forward failed on rank %d after %d collectives; completing its peers' collectives "
                "stopped after %d: %s",
                self.rank,
                self._issued,
                issued,
                exc,
            )
            self.placeholders += issued
            return
        self.placeholders += issued
        if issued:
            log.warning(
                "a capture forward failed on rank %d after %d collectives: issued its peers' %d remaining ones",
                self.rank,
                self._issued,
                issued,
            )
            self.completed += 1

    def _issue(self, entry: dict) -> None:
        """Issue the collective `entry` describes with zero tensors of its shapes, and wait for it."""
        op = getattr(getattr(torch.ops._c10d_functional, entry["op"]), entry["overload"])
        args, kwargs = _decode(entry["args"], self.device), _decode(entry["kwargs"], self.device)
        if entry["op"].startswith("all_to_all") and any(isinstance(a, list) and a for a in args[1:3]):
            raise _Unfollowable(f"{entry['op']} with per-rank split sizes: this rank's own splits are not known")
        out = op(*args, **kwargs)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            torch.ops._c10d_functional.wait_tensor(tensor)

    def _ranks_of(self, func: Any, args: tuple, kwargs: dict) -> list[int]:
        """The world ranks of the group a functional collective names (its `group_name` argument)."""
        names = [argument.name for argument in func._schema.arguments]
        position = names.index("group_name") if "group_name" in names else -1
        name = kwargs.get("group_name", args[position] if 0 <= position < len(args) else None)
        if not isinstance(name, str):
            return []
        ranks = self._groups.get(name)
        if ranks is None:
            import torch.distributed as dist

            group = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # torch stubs: a GroupName (a NewType of str)
            ranks = self._groups[name] = list(dist.get_process_group_ranks(group))
        return ranks


class _Stream:
    """One partner's entries of a segment, read in order: `at(index)` waits for entry `index` of segment `number`."""

    def __init__(self, store: Any, prefix: str, number: int) -> None:
        self.store, self.prefix, self.number = store, prefix, number
        self.entries: list[dict] = []
        self.closed = False

    def at(self, index: int, deadline: float) -> dict | None:
        """Entry `index`, or None when the partner closed its stream before it; `TimeoutError` past `deadline`.

        The key of an entry is reused by every segment: until the partner reaches it in this one, it holds an
        earlier segment's entry (or nothing), and is read again after a pause."""
        import datetime

        pause = 0.0005
        while index >= len(self.entries) and not self.closed:
            left = deadline - time.monotonic()
            key = f"{self.prefix}/{len(self.entries)}"
            try:
                if left <= 0:
                    raise RuntimeError("failure_timeout passed")
                self.store.wait([key], datetime.timedelta(seconds=left))
            except RuntimeError as exc:  # the store's "Wait timeout" (DistStoreError is a RuntimeError)
                raise TimeoutError(f"partner entry {key} was not published in time ({exc})") from None
            entry = json.loads(self.store.get(key))
            if entry.get("segment") != self.number:  # an earlier segment's: the partner is not there yet
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            elif "end" in entry:
                self.closed = True
            else:
                self.entries.append(entry)
        return self.entries[index] if index < len(self.entries) else None


def _signature(value: Any) -> Any:
    """A hashable stand-in of a collective's arguments: each tensor as its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _signature(item)) for key, item in value.items())
    return value


def _line(entry: dict) -> bytes:
    return (json.dumps(entry, separators=(",", ":")) + "\n").encode()


def _encode(value: Any) -> Any:
    """Tensors as their shape and dtype, lists and dicts element by element, the rest as it is (JSON)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    if isinstance(value, dict):
        return {"dict": {key: _encode(item) for key, item in value.items()}}
    return value


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(item, device) for item in value]
    if isinstance(value, dict) and "tensor" in value:
        return torch.zeros(value["tensor"], dtype=getattr(torch, value["dtype"]), device=device)
    if isinstance(value, dict):
        return {key: _decode(item, device) for key, item in value["dict"].items()}
    return value
