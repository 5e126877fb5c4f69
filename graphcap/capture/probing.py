"""Probing: the verification runs of one captured key, each a replay against an eager run of the same batch.

`verify_dummy` replays the batch the key was captured with; `verify_probes` a `probe_batch` at each
of `probe_fills(key)` (one real token, about half, all but one; requests likewise), so padded rows
run at every share of the key. A mismatch raises `CaptureError` (`compare_replay`); where the forward
carries state between runs, the message names it (`diagnosis`, `graphcap.capture.carried`). The
`CapturePass` gives what they need: its staging path, forward, outputs, tolerance and scratch blocks.

A probe batch that writes nothing depends on its real counts, not on the key it probes (`probe_batch`), so
keys of one pass probe the same batches: one token for every key, uniform and mixed keys of one size alike.
Its eager result is computed once per pass and kept until the pass's last probe of it (`SharedReferences`);
every key's replay is still compared with it. A replay that differs from a kept result is compared again
with a fresh eager run, whose verdict stands, so keeping a result never decides a comparison. A batch that
writes scratch blocks is each key's own, run eagerly for it: the same batch would find its slots holding
what an earlier key's probe wrote, and a graph that never writes them would pass. So is every batch of a
pass where an engine buffer takes its own sampler's values (`BufferSpec(sample=...)`): they may name state the
step writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from graphcap.backends import CapturedGraph
from graphcap.batch import StepBatch
from graphcap.capture.carried import carried_state
from graphcap.capture.verification import DUMMY_MISMATCH, LastRun, differs, probe_mismatch
from graphcap.errors import CaptureError
from graphcap.inputs import ForwardInputs
from graphcap.keys import GraphKey, Mode
from graphcap.outputs import cloned, flatten_output
from graphcap.piecewise import running
from graphcap.probe import REFERENCE_BYTES, Fill, probe_batch, probe_fills, probes_of
from graphcap.staging.extras import domain_hint

if TYPE_CHECKING:
    from graphcap.capture.runner import CapturePass

__all__ = [
    "SharedReferences",
    "batch_fingerprint",
    "diagnosis",
    "expected_probes",
    "verify_batch",
    "verify_dummy",
    "verify_probes",
]


class SharedReferences:
    """The eager results of one pass's probe batches, by `batch_fingerprint`, for the keys that probe the same batch
    (and the batches themselves, `batches`, made once a pass, with peers too).

    A result is kept only while a later key of the pass will probe its batch (`expect` counts the probes to come,
    `done` counts one off and drops what no later probe reads), so the pass holds the results of few batches at
    once: one token's, and those of keys of one size. Off (`enabled` False) with peers: a rank that kept a result
    would skip an eager run, and its collectives, that a rank whose probe batch differs (other scratch blocks)
    still runs. Results are copies, at most `limit` bytes in all; the pass drops them when it ends (`clear`).
    """

    def __init__(self, enabled: bool, limit: int = REFERENCE_BYTES) -> None:
        self.enabled = enabled
        self.limit = limit
        self.kept: dict[tuple, Any] = {}
        self.bytes = 0
        self.hits = 0
        """Eager runs not repeated: probes whose reference was kept."""
        self.batches: dict[tuple, tuple[StepBatch, bool]] = {}
        """The pass's probe batches (sampled, and whether they write), by `expected_probes`' identity: made once."""
        self._held: dict[tuple, list[tuple[tuple, int]]] = {}  # batch -> [(fingerprint, bytes)] kept for it
        self._left: dict[GraphKey, Counter] = {}  # key -> its probes still to come, by batch

    @property
    def uses(self) -> Counter:
        """Probes still to come per batch (`expected_probes`' identity), over every key."""
        return sum(self._left.values(), Counter())

    def _uses(self, made: tuple) -> int:
        return sum(left[made] for left in self._left.values())

    def expect(self, probes: Mapping[GraphKey, list[tuple]]) -> None:
        """Count the probes the pass will run: each key's (`expected_probes`)."""
        for key, made in probes.items():
            self._left.setdefault(key, Counter()).update(made)

    def abandon(self, key: GraphKey) -> None:
        """`key`'s probes that did not run (its capture or verification failed) count off as if they had."""
        for made in self._left.pop(key, Counter()):
            self._drop_unread(made)

    def get(self, fingerprint: tuple | None) -> Any:
        """The kept result of the batch `fingerprint` names, or None."""
        if fingerprint is None or not self.enabled:
            return None
        return self.kept.get(fingerprint)

    def keep(self, fingerprint: tuple | None, output: Any, made: tuple) -> None:
        """Keep a copy of `output` (the eager real rows of `made`'s batch, probed now) when a later probe will read
        it and the pass's budget allows."""
        if fingerprint is None or not self.enabled or fingerprint in self.kept or self._uses(made) <= 1:
            return
        leaves, rebuild = flatten_output(output, "this step", "the forward of")
        size = sum(t.numel() * t.element_size() for t in leaves)
        if self.bytes + size <= self.limit:
            self.kept[fingerprint] = rebuild([t.clone() for t in leaves])
            self._held.setdefault(made, []).append((fingerprint, size))
            self.bytes += size

    def done(self, key: GraphKey, made: tuple) -> None:
        """`key`'s probe of `made`'s batch ran: what no later probe reads is dropped."""
        left = self._left.get(key)
        if left is None or left[made] <= 0:
            return
        left[made] -= 1
        self._drop_unread(made)

    def _drop_unread(self, made: tuple) -> None:
        """Drop `made`'s batch and kept results once no probe of it is to come."""
        if self._uses(made) > 0:
            return
        self.batches.pop(made, None)
        for fingerprint, size in self._held.pop(made, ()):
            del self.kept[fingerprint]
            self.bytes -= size

    def clear(self) -> None:
        """Drop every kept result and batch (the pass ends)."""
        self.kept.clear()
        self.batches.clear()
        self._held.clear()
        self._left.clear()
        self.bytes = 0


def expected_probes(job: CapturePass, keys: Iterable[GraphKey]) -> dict[GraphKey, list[tuple]]:
    """Per key, the batch identity of every probe that verifying it runs (`graphcap.probe.probes_of`)."""
    max_model_len = job.config.kv_cache.max_model_len
    probes = {}
    for key in keys:
        shape = job.registry.capture_shape(key)
        fills = probe_fills(shape, max_model_len=max_model_len)
        probes[key] = [made for _, made in probes_of(shape, fills, piecewise=key.piecewise)]
    return probes


def batch_fingerprint(batch: StepBatch, *parts: Any) -> tuple | None:
    """Every value of `batch` (counts, ids, lengths, block tables, extras, axes) and `parts`, as one hashable
    tuple: two batches with equal fingerprints are the same step. None for a batch holding values it cannot read."""
    items: list[Any] = [parts, batch.num_tokens, batch.num_reqs, tuple(sorted(batch.axes.items()))]
    named = [("q", batch.query_lens), ("s", batch.seq_lens), ("ids", batch.input_ids), ("blocks", batch.block_table)]
    named += [(f"group:{name}", table) for name, table in sorted(batch.kv_groups.items())]
    named += [(f"extra:{name}", values) for name, values in sorted(batch.extras.items())]
    for name, values in named:
        if values is None:
            items.append((name, None))
            continue
        if not isinstance(values, np.ndarray):
            return None
        items.append((name, values.dtype.str, values.shape, values.tobytes()))
    return tuple(items)


def verify_dummy(
    job: CapturePass, key: GraphKey, graph: CapturedGraph, timings: dict | None = None, reference: LastRun | None = None
) -> float:
    """Replay the key's dummy batch against an eager run of it (`reference`: the last warmup's output, which
    ran it eagerly just before); the seconds of eager work not counted with the warmups.

    A reference that was the batch's first run (`LastRun.first`) read no state an earlier run left, where the
    replay did: when it differs, the replay is compared again with an eager run after it (as with no reference),
    whose verdict and diagnosis stand.
    """
    inputs = job.stage(job.capture_batch(key), key, phase="capture", dummy=True)
    if reference is not None and reference.output is not None:  # the last warmup ran this batch eagerly
        timings = {} if timings is None else timings
        run = job._reference_run(inputs, job.registry.mode_of(key))
        # No diagnosis against a first run: its runs would change the state the comparison below reads.
        diagnose = (
            None
            if reference.first
            else diagnosis(job, graph, inputs, lambda: job.outputs.real(run(), inputs), lambda: inputs)
        )
        try:
            job.compare(
                graph, inputs, lambda: reference.output, message=DUMMY_MISMATCH, timings=timings, diagnose=diagnose
            )
        except CaptureError:
            if not reference.first:
                raise
            inputs = job.stage(job.capture_batch(key), key, phase="capture", dummy=True)
        else:
            timings["eager"] = reference.seconds
            return 0.0  # counted with the warmups
    run = job._reference_run(inputs, job.registry.mode_of(key))
    eager = lambda: job.outputs.real(run(), inputs)  # noqa: E731
    return job.compare(
        graph,
        inputs,
        eager,
        message=DUMMY_MISMATCH,
        timings=timings,
        diagnose=diagnosis(job, graph, inputs, eager, lambda: inputs),
    )


def verify_probes(job: CapturePass, key: GraphKey, graph: CapturedGraph) -> tuple[float, tuple[Fill, ...]]:
    """Verify `key` on a probe batch at each of `probe_fills(key)`; the eager seconds and the fills."""
    kv, shape = job.config.kv_cache, job.registry.capture_shape(key)
    probes = probes_of(shape, probe_fills(shape, max_model_len=kv.max_model_len), piecewise=key.piecewise)
    seconds = 0.0
    # An engine's own sampler may name state the step writes (a float buffer's default sampling names nothing).
    own = any(spec.sample is not None and spec.sample != "pad" for spec in job.extras)
    for fill, made in probes:
        probe = job.references.batches.get(made)
        if probe is None:
            batch, writes = probe_batch(
                shape,
                max_model_len=kv.max_model_len,
                block_size=kv.block_size,
                num_blocks=kv.num_blocks,
                vocab_size=job.config.model.vocab_size,
                scratch_blocks=job.scratch_blocks,
                groups=job.kv_groups,
                group_scratch=job.group_scratch,
                fill=fill,
                own=own,
                seed=int(key.piecewise),  # a piecewise key's batches are not a full key's of its shape
            )
            probe = (job._sampled(batch, 1, dict(key.axes)), writes)
            if not (writes or own):  # a batch that writes is the key's own (`probe_batch`): never shared
                job.references.batches[made] = probe
        if probe[1] or own:
            seconds += verify_batch(job, key, graph, *probe)
            job.references.done(key, made)
        else:
            seconds += verify_batch(job, key, graph, *probe, made=made)
    return seconds, tuple(fill for fill, _ in probes)


def verify_batch(
    job: CapturePass, key: GraphKey, graph: CapturedGraph, batch: StepBatch, writes: bool, *, made: tuple | None = None
) -> float:
    """Replay `batch` (a probe) on `key`'s graph against an eager run of it at its own counts; `made`: the batch's
    identity in the pass (`expected_probes`), whose eager result is then shared with the pass's later probes of it."""
    stage = lambda: job.stage(batch, key, phase="capture", dummy=True, kv_writes=writes)  # noqa: E731
    inputs = stage()
    phase = "eager" if job.registry.mode_of(key) is Mode.PIECEWISE else "full"

    def eager() -> Any:
        axes = job.registry.axis_values(batch.axes)  # the batch's own key-axis values (capture.axes)
        eager_key = job.registry.eager_key(batch.num_tokens, batch.num_reqs, axes)
        eager_inputs = job.stage(batch, eager_key, phase="eager", dummy=True, kv_writes=writes)
        with running(eager_inputs, phase):  # the graph's code path: full graphs ran capturable stand-ins
            return job.outputs.real(job.forward(eager_inputs), eager_inputs)

    shape = job.registry.capture_shape(key)
    message = probe_mismatch(batch.num_tokens, batch.num_reqs, key.num_tokens, shape.num_reqs, writes)
    references = job.references
    fingerprint = batch_fingerprint(batch, phase, writes) if references.enabled and made is not None else None
    kept = references.get(fingerprint)
    if kept is not None:
        try:
            job.compare(graph, inputs, lambda: kept, message=message)
        except CaptureError:  # a fresh eager run decides, as with nothing kept
            inputs = stage()
        else:
            references.hits += 1
            references.done(key, made)
            return 0.0
    result: list[Any] = []

    def fresh() -> Any:
        result.append(eager())
        return result[-1]

    seconds = job.compare(graph, inputs, fresh, message=message, diagnose=diagnosis(job, graph, inputs, eager, stage))
    if made is not None:
        references.keep(fingerprint, result[0], made)
        references.done(key, made)
    return seconds


def diagnosis(
    job: CapturePass,
    graph: CapturedGraph,
    inputs: ForwardInputs,
    eager: Callable[[], Any],
    stage: Callable[[], ForwardInputs],
) -> Callable[[Any, Any], str | None] | None:
    """What `compare_replay` asks when a replay of the staged `inputs` and an eager run differ: whether the forward
    carries state between runs (`carried_state`), and which tensors it changed (not staged, not weights).

    None with data- or tensor-parallel peers: the runs it adds may hold collectives that peers whose
    comparison passed would not join.
    """
    if job.failures.peers is not None:
        return None

    def replay_again() -> Any:
        staged = stage()
        with running(staged):
            return job.outputs.real(cloned(graph.replay()), staged)

    def diagnose(replayed: Any, expected: Any) -> str | None:
        hint = domain_hint(job.extras, flatten_output(replayed, "replay")[0], flatten_output(expected, "eager")[0])
        if hint is not None:
            return hint
        staged = set(inputs.tensors())
        state = {
            name: tensor
            for name, tensor in job.static_inputs(inputs).items()
            if name not in staged and not isinstance(tensor, torch.nn.Parameter)
        }
        T, R = inputs.key.num_tokens, inputs.key.num_reqs
        counts = f"{inputs.num_tokens} of {T} tokens, {inputs.num_reqs} of {R or inputs.num_reqs} requests real"
        with torch.inference_mode():
            return carried_state(
                state,
                eager_again=eager,
                replay_again=replay_again,
                differ=differs(job.config.checks.tolerance, job.precision),
                first=(replayed, expected),
                batch=counts,
            )

    return diagnose
