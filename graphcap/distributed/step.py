"""`StepAgreement`: one step with data- and tensor-parallel peers, in the order that never strands one.

A step's graph (or eager forward) may hold collectives, so a rank that leaves a step its peers
run leaves them blocked in it. The order, per `execute` (and `dispatch`, which runs nothing):

1. Validate before agreeing: the rank stages its batch for its own key. A refused batch
   (`BatchError`) makes the rank join the step as an idle rank (no requests): its peers
   complete the step, then it raises the refusal.
2. Tensor-parallel check (with a TP group): one agreement over the TP group of a digest of the
   staged host rows (CRC-32 of the packed prefix the upload copies). TP ranks must stage the
   same rows; if they differ, every TP rank joins the step idle and raises `BatchError`.
3. Data-parallel agreement (with a DP group): one agreement of the MAX of the token and request
   counts, "cannot use a graph" and "not uniform", and every rank's token count; every rank
   reaches the same key, or every rank runs eagerly. `pad_eager`: an eager step pads to the
   agreed (largest) token and request counts on every rank, so an eager forward's collectives
   have one shape everywhere. The per-rank token counts are the model's to read
   (`inputs.extras["num_tokens_across_dp"]`, with `dp_token_counts=True`).
4. The manager stages for the agreed key and runs; a refusal found then (the model's `prepare`,
   the invariants) also runs the step idle before raising. A collective error inside the step
   becomes `DistributedTimeoutError` naming the step and the key.

Every agreement carries the step number and the call (see `GroupSync`), so ranks out of step
fail at the first mismatched call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from graphcap.batch import IDLE, StepBatch
from graphcap.config.fingerprint import agreed_items, fingerprint_int
from graphcap.distributed.sync import GroupSync
from graphcap.errors import BatchError, DistributedTimeoutError, InvariantViolation
from graphcap.inputs import BufferSpec, ForwardInputs
from graphcap.keys import Dispatch, GraphKey, KeyRegistry, Mode

__all__ = ["COUNTS_BUFFER", "AgreedStep", "StepAgreement", "counts_buffers", "is_collective_error"]

COUNTS_BUFFER = "num_tokens_across_dp"
"""The engine buffer of per-rank token counts (`dp_token_counts=True`): int32 [DP world size]."""


def counts_buffers(group: Any, enabled: bool) -> tuple[BufferSpec, ...]:
    """The engine buffer that holds every DP rank's token count, when `enabled` (and a group is given)."""
    if not enabled:
        return ()
    if group is None:
        raise ValueError("dp_token_counts=True needs a data-parallel group (group=...)")
    import torch.distributed as dist

    return (BufferSpec(COUNTS_BUFFER, "none", shape=(dist.get_world_size(group),), dtype="int32"),)


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

    def refuse(self, error: BaseException) -> tuple[StepBatch, Dispatch]:
        """Join the step idle after `error` (a refusal after the agreement); re-raise if already idle."""
        if self.batch is IDLE:
            raise error
        self.refused, self.batch = error, IDLE
        if self.dispatch.mode is Mode.EAGER:
            self.dispatch = self.dispatch._replace(key=_eager_key(IDLE, self.padded))
        return self.batch, self.dispatch

    def raise_refusal(self) -> None:
        if self.refused is not None:
            raise self.refused


class StepAgreement:
    """The agreements of one manager with its DP and TP peers (see the module doc).

    `stage(batch, key)`: stage without uploading (the validation of step 1). `packed_prefix(key,
    num_reqs)`: the staged host bytes of a key (the TP digest). Holds the step count: steps
    are `execute` calls; `dispatch` is a look at the next step.
    """

    def __init__(
        self,
        registry: KeyRegistry,
        stage: Any,
        packed_prefix: Any,
        *,
        group: Any,
        tp_group: Any,
        timeout: float,
        pad_eager: bool,
        token_counts: bool,
    ) -> None:
        import torch.distributed as dist

        self.dp = GroupSync(group, timeout, "data-parallel") if group is not None else None
        self.tp = GroupSync(tp_group, timeout, "tensor-parallel") if tp_group is not None else None
        self.syncs = [sync for sync in (self.dp, self.tp) if sync is not None]
        self.rank = dist.get_rank()
        self.registry = registry
        self._stage = stage
        self._packed_prefix = packed_prefix
        self.pad_eager = pad_eager
        self.token_counts = token_counts
        self.steps = 0
        """Steps executed: the number of the last `execute`."""
        self.current: AgreedStep | None = None

    @classmethod
    def create(
        cls,
        config: Any,
        registry: KeyRegistry,
        buffers: Any,
        group: Any,
        tp_group: Any,
        timeout: float,
        pad_eager: bool,
        token_counts: bool,
    ) -> StepAgreement | None:
        """The agreements of a manager over `buffers` (`PersistentBuffers`), None without groups.

        Collective: the ranks agree on `config` (and the torch and graphcap versions) first.
        """
        if (pad_eager or token_counts) and group is None:
            raise ValueError("pad_eager and dp_token_counts need a data-parallel group (group=...)")
        if group is None and tp_group is None:
            return None
        peers = cls(
            registry,
            lambda batch, key: buffers.stage(batch, key, upload=False),
            lambda key, num_reqs: buffers.packed_host[: buffers.upload_nbytes(key, num_reqs)],
            group=group,
            tp_group=tp_group,
            timeout=timeout,
            pad_eager=pad_eager,
            token_counts=token_counts,
        )
        peers.agree_on_config(fingerprint_int(config), agreed_items(config))
        return peers

    # -- agreements outside steps ----------------------------------------------------------

    def agree_on_config(self, fingerprint: int, items: Mapping[str, str]) -> None:
        for sync in self.syncs:
            sync.agree_on_config(fingerprint, items)

    def begin_capture(self, call: str = "capture") -> None:
        """Before a capture pass (`call`: "capture" or "capture_pending") runs anything: ranks capturing while a
        peer steps (or makes the other call) fail here, out of step, each rank's call named."""
        self.current = None
        for sync in self.syncs:
            sync.agree(self.steps, call)

    def first_failed(self, failed: bool, kind: str, what: str) -> int | None:
        """The lowest world rank that failed `what` (DP, then TP: every rank of a TP x DP grid learns it)."""
        known = self.rank if failed else None
        for sync in self.syncs:
            known = sync.first_failed(known, self.steps, kind, what)
        return known

    # -- a step ----------------------------------------------------------------------------

    def plan(self, batch: StepBatch, call: str, number: int | None = None) -> AgreedStep:
        """Steps 1-3 of the module doc for `call` ("execute" or "dispatch") of step `number` (the engine's, which
        every rank must share; default: the steps executed + 1); collective."""
        if number is None:
            number = self.steps + 1
        elif isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"step must be an int >= 0 (the engine's step number); got {number!r}")
        refused: BaseException | None = None
        counted = call == "execute"  # a dispatch() is a query: no traffic for lazy capture
        own, uniform = self._own(batch, counted)
        try:
            self._stage(batch, own.key)
        except BatchError as exc:
            refused, batch = exc, IDLE
            own, uniform = self._own(batch, counted)
        if self.tp is not None:
            digest = 1 if refused is not None else self._digest(batch, own.key)
            digests = self.tp.agree(number, call, value=digest).values
            if len(set(digests)) > 1:
                shown = ", ".join(f"rank {self.tp.ranks[i]}: {d:x}" for i, d in enumerate(digests))
                mismatch = BatchError(
                    f"step {number}: the tensor-parallel ranks staged different rows (digests {shown}; 1: a "
                    "refused batch); every rank of a tensor-parallel group must execute the same batch. "
                    "Every rank of the group ran this step idle"
                )
                mismatch.__cause__ = refused
                refused, batch = mismatch, IDLE
                own, uniform = self._own(batch, counted)
        dispatch, counts, padded = own, (batch.num_tokens,), None
        if self.dp is not None:
            dispatch, counts, padded = self._agree_dp(number, call, batch, uniform, own)
        step = AgreedStep(number, dispatch, batch, counts, padded, refused)
        if call == "execute":
            self.steps = number
        return step

    def execute(self, batch: StepBatch, run: Callable[[StepBatch, Dispatch], Any], number: int | None = None) -> Any:
        """One agreed step: `run(batch, dispatch)`, again idle when the manager refuses the batch after the
        agreement (the model's `prepare`, the invariants), then raise the refusal (collective)."""
        step = self.plan(batch, "execute", number)
        with self.running(step):
            try:
                output = run(step.batch, step.dispatch)
            except (BatchError, InvariantViolation) as exc:
                output = run(*step.refuse(exc))
        step.raise_refusal()
        return output

    @contextlib.contextmanager
    def running(self, step: AgreedStep) -> Iterator[None]:
        """Around the agreed step's run: its counts for `write_counts`; collective errors named."""
        self.current = step
        try:
            yield
        except Exception as exc:
            if not is_collective_error(exc):
                raise
            first = (str(exc).strip().splitlines() or ["no detail"])[0][:200]
            raise DistributedTimeoutError(
                f"step {step.number}: {step.dispatch.key}: a collective inside the forward failed on rank {self.rank} "
                f"({first}); a peer died or left the step (every rank runs the step's collectives together). The "
                "process group is unusable: restart the ranks"
            ) from exc
        finally:
            self.current = None

    def write_counts(self, inputs: ForwardInputs) -> None:
        """Fill the per-rank token counts of the step being staged (graphcap's batches: the same on every rank)."""
        if not self.token_counts:
            return
        view = inputs.host.extras[COUNTS_BUFFER]
        step = self.current
        if step is None:
            view.fill(inputs.num_tokens)
        else:
            view[...] = step.counts

    def _own(self, batch: StepBatch, count: bool = True) -> tuple[Dispatch, bool]:
        uniform = batch.is_uniform(self.registry.uniform_query_len)
        return self.registry.dispatch(batch.num_tokens, batch.num_reqs, uniform, count=count), uniform

    def _digest(self, batch: StepBatch, key: GraphKey) -> int:
        """CRC-32 of the staged host rows and the counts, >= 2 (1 marks a refused batch)."""
        seed = zlib.crc32(f"{key}/{batch.num_tokens}/{batch.num_reqs}".encode())
        return zlib.crc32(self._packed_prefix(key, batch.num_reqs), seed) + 2

    def _agree_dp(
        self, number: int, call: str, batch: StepBatch, uniform: bool, own: Dispatch
    ) -> tuple[Dispatch, tuple[int, ...], tuple[int, int] | None]:
        """The dispatch every DP rank reaches from the reduced counts.

        An idle rank (no requests) joins any key; a rank whose own step could not replay gives
        its own reason, the others `peer`.
        """
        registry = self.registry
        cannot = own.mode is Mode.EAGER and not (batch.num_reqs == 0 and registry.mode != "none")
        payload = [batch.num_tokens, int(cannot), int(not uniform), batch.num_reqs]
        agreement = self.dp.agree(number, call, payload, value=batch.num_tokens)
        num_tokens, any_cannot, any_mixed, num_reqs = agreement.payload
        counts = tuple(agreement.values)
        padded = (num_tokens, num_reqs) if self.pad_eager else None
        eager = Dispatch(Mode.EAGER, _eager_key(batch, padded), own.reason if own.mode is Mode.EAGER else "peer")
        if any_cannot:
            return eager, counts, padded
        agreed = registry.dispatch(num_tokens, num_reqs, not any_mixed, count=call == "execute")
        return (eager if agreed.mode is Mode.EAGER else agreed), counts, padded


def _eager_key(batch: StepBatch, padded: tuple[int, int] | None) -> GraphKey:
    """The key of an eager step: the batch's own counts, or the counts every rank pads to."""
    num_tokens, num_reqs = padded if padded is not None else (batch.num_tokens, batch.num_reqs)
    return KeyRegistry.eager_key(num_tokens, num_reqs)


def is_collective_error(exc: BaseException) -> bool:
    """Whether `exc` comes from a collective (a torch.distributed error, or gloo's/NCCL's RuntimeError)."""
    if isinstance(exc, DistributedTimeoutError) or not isinstance(exc, RuntimeError):
        return False
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "c10d", "ProcessGroup"))
