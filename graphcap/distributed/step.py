"""`StepAgreement`: one step with data- and tensor-parallel peers, in the order that never strands one.

A step's graph (or eager forward) may hold collectives, so a rank that leaves a step its peers
run leaves them blocked in it. The order, per `execute` (and `dispatch`, which runs nothing):

1. Validate before agreeing: the rank stages its batch for its own key. A refused batch
   (`BatchError`) makes the rank join the step as an idle rank (no requests): its peers
   complete the step, then it raises the refusal.
2. Tensor-parallel check (with a TP group): one agreement over the TP group of a digest of the
   staged host rows of the rank's own key (CRC-32 of each field's rows for that key, never the
   capacity past them, which still holds what a larger earlier step wrote). TP ranks must stage
   the same rows; if they differ, every TP rank joins the step idle and raises `BatchError`.
3. Data-parallel agreement (with a DP group): one agreement of the MAX of the token and request
   counts, "cannot use a graph" (the rank's own step past `capture.max_padding_factor`, or a static
   input moved on it: checked before agreeing), "not uniform" and each key axis's value (`capture.axes`), and
   every rank's token count; every rank reaches the same key (the same combination of axis
   values), or every rank runs eagerly. Padded eager steps (`Parallel.pad_eager`;
   by default whenever the forward may hold a collective): an eager step pads to the agreed
   (largest) token and request counts and axis values on every rank, so an eager forward's
   collectives have one shape everywhere. The per-rank token counts are the model's to read
   (`inputs.extras["num_tokens_across_dp"]`, with `Parallel(token_counts=True)`). Lazy demand
   counts the agreed key, never a rank's own.
4. The manager stages for the agreed key and runs; a refusal found then (the model's `prepare`,
   the invariants) also runs the step idle before raising. With a TP group, one more TP
   agreement before the launch (`staged`) tells every TP rank whether each one's rows passed:
   a refused TP rank's peers raise too and run idle, instead of reducing with its padding rows.
   A collective error inside the step becomes `DistributedTimeoutError` naming the step and the key.

Every agreement carries the step number and the call (see `GroupSync`), so ranks out of step
fail at the first mismatched call. Every call agrees TP, then DP (`order`); on a grid, ranks out
of step in the TP agreement join the DP one flagged, so every rank of the grid raises (`_agree`).
The calls that change the live graphs between steps
(`release`, `resize_kv`, `reset`) are agreed too (`agree_call`): one rank calling one alone fails
at once on every rank, naming each rank's call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from graphcap.batch import IDLE, StepBatch
from graphcap.config.fingerprint import agreed_items
from graphcap.distributed.agreed import COUNTS_BUFFER, AgreedStep, counts_buffers, eager_key, is_collective_error
from graphcap.distributed.options import Parallel, agreed_options
from graphcap.distributed.sync import KINDS, Agreement, GroupSync, call_word, config_mismatch, out_of_step
from graphcap.errors import BatchError, DistributedTimeoutError, InvariantViolation, StaticInputMovedError
from graphcap.inputs import ForwardInputs
from graphcap.keys import Dispatch, GraphKey, KeyRegistry, Mode

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig
    from graphcap.staging import PersistentBuffers

__all__ = ["COUNTS_BUFFER", "AgreedStep", "StepAgreement", "counts_buffers", "is_collective_error"]

_next_ledger = 0
"""The serial the next manager with peers proposes for its ledger (`StepAgreement.ledger`)."""


class StepAgreement:
    """The agreements of one manager with its DP and TP peers (see the module doc).

    `stage(batch, key)`: stage without uploading (the validation of step 1). `key_rows(key,
    num_reqs)`: the staged host rows of a key by field (the TP digest). Holds the step count:
    steps are `execute` calls; `dispatch` is a look at the next step.
    """

    def __init__(self, registry: KeyRegistry, stage: Any, key_rows: Any, parallel: Parallel) -> None:
        import torch.distributed as dist

        timeout = parallel.timeout
        self.dp = GroupSync(parallel.dp_group, timeout, "data-parallel") if parallel.dp_group is not None else None
        self.tp = GroupSync(parallel.tp_group, timeout, "tensor-parallel") if parallel.tp_group is not None else None
        self.syncs = [sync for sync in (self.dp, self.tp) if sync is not None]
        """DP, then TP: the order of construction's and a capture pass's own agreements."""
        self.order = [sync for sync in (self.tp, self.dp) if sync is not None]
        """TP, then DP: the order of every call's agreement (steps, capture passes starting, lifecycle calls)."""
        self.rank = dist.get_rank()
        self.registry = registry
        self._stage = stage
        self._key_rows = key_rows
        self.pad_eager = parallel.pad_eager
        """True/False: the engine's choice; None: pad while `forward_collectives` is not False."""
        self.forward_collectives: bool | None = None
        """Whether the captured forward holds a collective: None until a capture tells (the manager sets it)."""
        self.token_counts = parallel.token_counts
        self.steps = 0
        """Steps executed: the number of the last `execute`."""
        self.current: AgreedStep | None = None
        self.ledger = 0
        """The serial of this manager's `CollectiveLedger` (its name in the store), agreed at construction."""
        self.check_statics: Callable[[], None] | None = None
        """The manager's static-input check (`StaticGuard.check`), run before a DP step's agreement."""

    @classmethod
    def create(
        cls,
        config: CaptureConfig,
        registry: KeyRegistry,
        buffers: PersistentBuffers,
        parallel: Parallel,
        statics: Callable[[], None] | None = None,
    ) -> StepAgreement | None:
        """The agreements of a manager over `buffers` (`PersistentBuffers`), None without groups; `statics`: its
        static-input check (`check_statics`).

        Collective: the ranks agree on `config` (and the torch and graphcap versions) first.
        """
        if not parallel.has_peers:
            return None

        def key_rows(key: GraphKey, num_reqs: int) -> Mapping[str, Any]:
            R = key.num_reqs if key.num_reqs is not None else num_reqs
            return buffers.layout.views(key.num_tokens, R).host

        peers = cls(registry, lambda batch, key: buffers.stage(batch, key, upload=False), key_rows, parallel)
        peers.check_statics = statics
        items = {**agreed_items(config), **agreed_options(parallel)}
        digest = hashlib.sha256(json.dumps(sorted(items.items())).encode()).digest()
        peers.agree_on_config(int.from_bytes(digest[:8], "big") >> 2, items)
        return peers

    # -- agreements outside steps ----------------------------------------------------------

    def agree_on_config(self, fingerprint: int, items: Mapping[str, str]) -> None:
        """Every rank of the DP and TP groups holds the same fingerprint, else every rank raises `ConfigError`
        naming each differing key and every rank's value (DP, then TP: on a TP x DP grid every rank learns
        every rank's config, so no rank is left waiting in a later agreement).

        The same reduction agrees the ledger's serial (`ledger`): the largest any rank of the grid proposes, so
        a manager with peers made on some ranks only (a draft model's) leaves no later manager's ranks naming
        their ledgers apart."""
        global _next_ledger
        highest, complement, serial = fingerprint, 2**62 - fingerprint, _next_ledger
        for sync in self.syncs:
            highest, complement, serial = sync.fingerprint_range(highest, complement, serial)
        self.ledger, _next_ledger = serial, serial + 1
        if highest == 2**62 - complement:  # the largest fingerprint is also the smallest: all equal
            return
        known = {self.rank: dict(items)}
        for sync in self.syncs:
            known = sync.gather(known)
        role = " x ".join(sync.role for sync in self.syncs)
        raise config_mismatch(known, role)

    def agree_call(self, kind: str, refused: BaseException | None = None, detail: str = "") -> None:
        """A call that changes the live graphs between steps (`kind`: "release", "resize_kv", "reset", "capture",
        "capture_pending") (collective): a rank that makes it alone fails here on every rank, naming each rank's
        call ("ranks out of step"); a call `refused` on any rank (checked before agreeing) raises on every rank,
        the refusing rank its own error, so no rank changes its graphs alone."""
        known, apart = (self.rank + 1 if refused is not None else 0), False
        for sync in self.order:  # TP, then DP, as steps: on a grid a call meets whatever its peers made
            agreement = self._agree(sync, self.steps, kind, value=known, detail=detail, apart=apart)
            apart, failed_ranks = agreement.apart, [value for value in agreement.values if value]
            known = min(failed_ranks) if failed_ranks else 0
        failed = known - 1 if known else None
        if refused is not None:
            raise refused
        if failed is not None:
            raise DistributedTimeoutError(
                f"{KINDS[kind][1]} after step {self.steps}: rank {failed} refused it (its own error names why); "
                "every rank keeps its graphs, so the ranks stay in step"
            )

    def begin_capture(self, call: str = "capture", refused: BaseException | None = None) -> None:
        """Before a capture pass (`call`: "capture" or "capture_pending") runs anything: ranks capturing while a
        peer steps (or makes the other call) fail here, out of step, each rank's call named; a pass `refused` on
        any rank before it wrote anything (a scratch block out of range, a report path, a moved static input)
        raises on every rank, the refusing rank its own error (`agree_call`)."""
        self.current = None
        self.agree_call(call, refused)

    def _agree(
        self,
        sync: GroupSync,
        number: int,
        kind: str,
        payload: Any = (),
        value: int = 0,
        detail: str = "",
        *,
        apart: bool = False,
    ) -> Agreement:
        """One agreement of a call, in the order every call keeps (`order`: TP, then DP).

        With one group, its agreement raises "ranks out of step" itself. On a TP x DP grid a rank whose TP
        agreement found the ranks out of step (`apart`) still joins its DP agreement, flagged: every DP group
        holds a rank of every TP group, so after the DP agreement every rank of the grid knows, and every rank
        gathers every rank's call and raises the same "ranks out of step", instead of leaving the ranks of
        the other groups waiting in their next agreement."""
        if len(self.order) == 1:
            return sync.agree(number, kind, payload, value, detail)
        agreement = sync.agree(number, kind, payload, value, detail, apart=apart)
        if agreement.apart and sync is self.order[-1]:
            known = {self.rank: call_word(number, kind, detail)}
            for each in self.order:
                known = each.gather_calls(known)
            what = f"step {number}: {kind}{f' of {detail}' if detail else ''}"
            raise out_of_step(known, what, " x ".join(each.role for each in self.order))
        return agreement

    def first_failed(self, failed: bool, kind: str, what: str) -> int | None:
        """The lowest world rank that failed `what` (DP, then TP: every rank of a TP x DP grid learns it)."""
        first = self.first_failure(failed, kind, what)
        return None if first is None else first[0]

    def first_failure(
        self, failed: bool, kind: str, what: str, *, derived: bool = False, phase: int = 0
    ) -> tuple[int, bool, int] | None:
        """(the world rank to name for failing `what`, whether its failure is derived, its phase code), or None.

        `derived`: this rank's failure may follow from a peer's (a verification mismatch after a peer's
        forward failed part-way): the lowest rank whose failure is not derived is named first. `phase`: the
        code of the capture phase this rank failed in (0: not known), which every rank learns with the rank."""
        known = (((1 << 22) if derived else 0) | (phase << 20) | self.rank) if failed else None
        for sync in self.syncs:
            known = sync.first_failed(known, self.steps, kind, what)
        if known is None:
            return None
        return known & ((1 << 20) - 1), bool(known >> 22), (known >> 20) & 3

    def partners(self) -> list[int]:
        """The world ranks of this rank's DP and TP groups (itself included)."""
        return sorted({rank for sync in self.syncs for rank in sync.ranks})

    def learn_collectives(self, graphs: Any, communicators: tuple = ()) -> None:
        """After a capture: whether the forward holds a collective, from what the graphs recorded (once True, kept)."""
        if self.forward_collectives is not True:
            from graphcap.communicators import holds_collectives

            seen = holds_collectives(graphs, communicators)
            if seen is not None:
                self.forward_collectives = seen

    def pads_eager(self) -> bool:
        """Whether this step's eager forward pads to the agreed counts (`Parallel.pad_eager`; None: unless a
        capture showed the forward holds no collective)."""
        if self.pad_eager is not None:
            return self.pad_eager
        return self.forward_collectives is not False

    # -- a step ----------------------------------------------------------------------------

    def plan(self, batch: StepBatch, call: str, number: int | None = None) -> AgreedStep:
        """Steps 1-3 of the module doc for `call` ("execute" or "dispatch") of step `number` (the engine's, which
        every rank must share; default: the steps executed + 1); collective."""
        if number is None:
            number = self.steps + 1
        elif isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"step must be an int >= 0 (the engine's step number); got {number!r}")
        refused: BaseException | None = None
        try:
            own, uniform = self._own(batch)  # an axis the config does not plan is a refusal too
            self._stage(batch, own.key)
        except BatchError as exc:
            refused, batch = exc, IDLE
            own, uniform = self._own(batch)
        cannot = False
        if self.dp is not None and refused is None and self.check_statics is not None and self.registry.captured:
            try:  # a static input replaced on this rank: refused before agreeing, every rank runs the step eagerly
                self.check_statics()
            except StaticInputMovedError as exc:
                refused, batch, cannot = exc, IDLE, True
                own, uniform = self._own(batch)
        apart = False
        if self.tp is not None:
            digest = 1 if refused is not None else self._digest(batch, own.key)
            agreement = self._agree(self.tp, number, call, value=digest)
            apart, digests = agreement.apart, agreement.values
            if not apart and len(set(digests)) > 1:
                shown = ", ".join(f"rank {self.tp.ranks[i]}: {d:x}" for i, d in enumerate(digests))
                own_reason = "" if refused is None else f"; this rank's batch was refused: {refused}"
                mismatch = BatchError(
                    f"step {number}: the tensor-parallel ranks staged different rows (digests {shown}; 1: a "
                    "refused batch); every rank of a tensor-parallel group must execute the same batch. "
                    f"Every rank of the group ran this step idle{own_reason}"
                )
                mismatch.__cause__ = refused
                refused, batch = mismatch, IDLE
                own, uniform = self._own(batch)
        counts: tuple[int, ...]
        dispatch, counts, padded = own, (batch.num_tokens,), None
        if self.dp is not None and apart:  # out of step in the TP agreement: tell the DP peers, then raise
            self._agree(self.dp, number, call, apart=True)
        if self.dp is not None:
            dispatch, counts, padded = self._agree_dp(self.dp, number, call, batch, uniform, own, cannot)
        elif own.mode is Mode.EAGER and call == "execute":  # the step's key: counted once, as without peers
            self.registry.dispatch(batch.num_tokens, batch.num_reqs, uniform, batch.axes)
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
                if not step.checked:  # refused before the TP peers' check: they learn it there and run idle too
                    self._check_staged(step, exc)
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

    def staged(self) -> None:
        """After the rank staged the agreed step's rows and they passed `prepare` and the invariants, before
        it launches anything (the manager calls it): with a TP group, one agreement that every TP rank's did.
        A TP rank refused then (its `prepare` broke a row) would run the step idle, and its peers' replay
        would all-reduce their partial sums with its padding rows: a wrong output without an error. So its
        peers raise `BatchError` naming it here, and every rank of the group runs the step idle."""
        step = self.current
        if step is not None and not step.checked:
            self._check_staged(step, None)

    def sampled(self, due: Callable[[], bool]) -> bool:
        """Whether the running step's replay is sampled (`checks.sample_every`; `due` counts one replay): asked
        once per agreed step, so a rank that runs a step twice (refused, then idle) counts it once and samples
        the same steps as its peers (every rank replays the same steps: their keys are agreed)."""
        step = self.current
        if step is None:
            return due()
        if step.sampled is None:
            step.sampled = due()
        return step.sampled

    def _check_staged(self, step: AgreedStep, refused: BaseException | None) -> None:
        step.checked = True
        if self.tp is None:
            return
        values = self.tp.agree(step.number, "staged", value=int(refused is not None)).values
        failed = [rank for rank, value in zip(self.tp.ranks, values) if value]
        if failed and refused is None:
            raise BatchError(
                f"step {step.number}: {step.dispatch.key}: the batch of tensor-parallel rank {failed[0]} was refused "
                "after the agreement (its own error names why); every rank of the tensor-parallel group ran this "
                "step idle, so no rank all-reduced with a rank that did not compute the batch"
            )

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

    def _own(self, batch: StepBatch) -> tuple[Dispatch, bool]:
        """This rank's own dispatch, not counted in the lazy demand (`plan` counts the step's key once)."""
        uniform = batch.is_uniform(self.registry.uniform_query_len)
        return self.registry.dispatch(batch.num_tokens, batch.num_reqs, uniform, batch.axes, count=False), uniform

    def _digest(self, batch: StepBatch, key: GraphKey) -> int:
        """CRC-32 of each field's staged host rows of `key` and the counts, >= 2 (1 marks a refused batch).

        Only the rows the key uses: the capacity past them holds what an earlier, larger step
        wrote, which TP peers need not share (a peer whose batch was refused did not write it).
        The per-rank token counts are left out: they are written after the agreement."""
        crc = zlib.crc32(f"{key}/{batch.num_tokens}/{batch.num_reqs}".encode())
        for name, rows in self._key_rows(key, batch.num_reqs).items():
            if name != COUNTS_BUFFER:
                crc = zlib.crc32(np.ascontiguousarray(rows).view(np.uint8).data, crc)
        return crc + 2

    def _agree_dp(
        self,
        dp: GroupSync,
        number: int,
        call: str,
        batch: StepBatch,
        uniform: bool,
        own: Dispatch,
        cannot: bool = False,
    ) -> tuple[Dispatch, tuple[int, ...], tuple[int, int] | None]:
        """The dispatch every DP rank reaches from the reduced counts.

        Whether a graph can serve is decided from the agreed key: it holds every rank's batch (its
        counts and axis values are the largest), and every rank holds the same graphs, so a rank's
        own key being pending or skipped does not keep its peers from replaying the agreed one. The
        rank-own reasons every rank honours ("cannot" in the payload) are `capture.max_padding_factor`
        on the rank's own step and `cannot` (a static input moved on this rank: it must not replay).
        When the step runs eagerly, a rank whose own step could not replay either gives its own
        reason, the others `peer`.
        """
        registry = self.registry
        cannot = cannot or (own.mode is Mode.EAGER and own.reason == "over_padding" and batch.num_reqs > 0)
        values = registry.axis_values(batch.axes)  # an idle rank: every axis at its smallest value
        payload = [batch.num_tokens, int(cannot), int(not uniform), batch.num_reqs, *(v for _, v in values)]
        agreement = self._agree(dp, number, call, payload, value=batch.num_tokens)
        num_tokens, any_cannot, any_mixed, num_reqs, *largest = agreement.payload
        axes = tuple(zip((name for name, _ in values), largest))  # each axis's largest value on any rank
        counts = tuple(agreement.values)
        padded = (num_tokens, num_reqs) if self.pads_eager() else None
        padded_key = eager_key(batch, padded, values if padded is None else axes)
        eager = Dispatch(Mode.EAGER, padded_key, own.reason if own.mode is Mode.EAGER else "peer")
        # Counts the agreed key's demand, once, for a step; a dispatch() is a query and counts nothing.
        agreed = registry.dispatch(num_tokens, num_reqs, not any_mixed, dict(axes), count=call == "execute")
        if any_cannot or agreed.mode is Mode.EAGER:
            return eager, counts, padded
        return agreed, counts, padded
