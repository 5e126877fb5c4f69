"""`Verifier`: the verification of one recorded key, each run a replay against an eager run of the same batch.

`verify(recorded)` replays the batch the key was captured with (`dummy`), a `probe_batch` at each of
`probe_fills(key)` (`fills`: one real token, about half, all but one; requests likewise), so padded rows run at
every share of the key, and the dummy batch stating lower key-axis values (`axes`: padded axis slots must be
neutral, as padded rows are). A mismatch raises `ReplayMismatchError` (`compare_replay`); where the forward
carries state between runs, the message names it (`diagnosis`, `graphcap.capture.carried`). `timed` measures
what a verified graph buys when `capture.min_speedup` decides. A failure is settled by the failure policy.

Probe batches that write nothing are shared by the keys of a pass (`SharedReferences`, injected). A batch that
writes scratch blocks is each key's own, run eagerly for it: the same batch would find its slots holding what an
earlier key's probe wrote, and a graph that never writes them would pass. So is every batch of a pass where an
engine buffer takes its own sampler's values (`BufferSpec(sample=...)`): they may name state the step writes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from graphcap.backends import CapturedGraph
from graphcap.batch import StepBatch, dummy_batch
from graphcap.capture.carried import carried_state
from graphcap.capture.failures import failing_in
from graphcap.capture.outcome import Recorded, Verified
from graphcap.capture.parts import CaptureParts
from graphcap.capture.recorder import Recorder, capture_reqs, dummy_counts
from graphcap.capture.references import SharedReferences, batch_fingerprint, key_probes
from graphcap.capture.timing import replay_speedup
from graphcap.capture.verification import (
    DUMMY_MISMATCH,
    LastRun,
    axes_mismatch,
    compare_replay,
    differs,
    probe_mismatch,
)
from graphcap.errors import CaptureError
from graphcap.inputs import ForwardInputs
from graphcap.keys import GraphKey, KeyRegistry, Mode
from graphcap.outputs import StepOutput, cloned, flatten_output
from graphcap.phases import in_phase
from graphcap.piecewise import Phase, running
from graphcap.probe import Fill, probe_batch
from graphcap.staging.extras import domain_hint

__all__ = ["Scratch", "Verifier", "lowered_axes"]

Eager = Callable[[], StepOutput]
Diagnose = Callable[[Any, Any], "str | None"]


class Scratch(NamedTuple):
    """KV blocks a pass's probe batches may write: `blocks` of the built-in cache, `groups` of each extra group."""

    blocks: tuple[int, ...] = ()
    groups: Mapping[str, tuple[int, ...]] = {}


NO_SCRATCH = Scratch()
"""A pass given no scratch blocks: its probes write no KV slot."""


class Verifier:
    """Verifies the keys of one pass with `parts`, the pass's `references` and `scratch`, on `recorder`'s batches.

    `precision`: the model's lowest floating parameter dtype (a 16-bit one sets how outputs are judged);
    `timer`: what times a key's replay against eager in `timed` (None: CUDA events or perf_counter).
    """

    def __init__(
        self,
        parts: CaptureParts,
        references: SharedReferences,
        recorder: Recorder,
        *,
        scratch: Scratch = NO_SCRATCH,
        precision: torch.dtype | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.parts, self.references, self.recorder = parts, references, recorder
        self.scratch, self.precision, self.timer = scratch, precision, timer

    def verify(self, recorded: Recorded, reference: LastRun | None = None) -> Verified:
        """Replay the key's dummy batch, a probe batch at each fill level and the lowered axis values, each against
        an eager run; the outcome is `verified` only when every one matched, its `verified_fills` the probes'
        counts. Collective with data-parallel ranks (every rank verifies every key, in order). A failure is settled
        by the policy: raised, or the key comes back skipped with no graph (the policy released it).
        """
        outcome, graph = recorded
        key, parts = outcome.key, self.parts
        failure: Exception | None = None
        start, eager_seconds = time.perf_counter(), 0.0
        fills: tuple[Fill, ...] = ()
        timings: dict[str, float] = {}
        with in_phase("verify"):
            if graph is not None:
                try:
                    with parts.segment():
                        eager_seconds = self.dummy(key, graph, timings, reference)
                        probe_seconds, fills = self.fills(key, graph)
                        eager_seconds += probe_seconds + self.axes(key, graph)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:
                    failure = exc
            elif outcome.status == "captured":
                failure = CaptureError(f"{key} has no graph to verify")
            self.references.abandon(key)  # its probes a failure left unrun count off
            reason = parts.failures.settle(f"capturing {key}", failure, graph)
        seconds = outcome.capture_seconds + time.perf_counter() - start
        if reason is not None:
            return Verified(outcome.skipped(reason, capture_seconds=seconds), None)
        if graph is None:
            return Verified(outcome, None)
        speedup = timings["eager"] / timings["replay"] if timings.get("replay") else None  # one sample each
        verified = dataclasses.replace(
            outcome,
            verified=True,
            capture_seconds=seconds,
            eager_seconds=eager_seconds + outcome.eager_seconds,
            speedup=speedup,
            verified_fills=tuple((fill.num_tokens, fill.num_reqs) for fill in fills),
        )
        return Verified(verified, graph)

    def dummy(
        self,
        key: GraphKey,
        graph: CapturedGraph,
        timings: dict[str, float] | None = None,
        reference: LastRun | None = None,
    ) -> float:
        """Replay the key's dummy batch against an eager run of it (`reference`: the last warmup's output, which
        ran it eagerly just before); the seconds of eager work not counted with the warmups.

        A reference that was the batch's first run (`LastRun.first`) read no state an earlier run left, where the
        replay did: when it differs, the replay is compared again with an eager run after it (as with no
        reference), whose verdict and diagnosis stand.
        """
        recorder, outputs = self.recorder, self.parts.outputs
        mode = self.parts.registry.mode_of(key)
        batch = recorder.capture_batch(key)
        with failing_in("the verification", dummy_counts(batch)):
            inputs = self.parts.stage(batch, key, phase="capture", dummy=True)
            if reference is not None and reference.output is not None:  # the last warmup ran this batch eagerly
                timings = {} if timings is None else timings
                run = recorder.reference_run(inputs, mode)
                # No diagnosis against a first run: its runs would change the state the comparison below reads.
                again = lambda: outputs.real(run(), inputs)  # noqa: E731
                diagnose = None if reference.first else self.diagnosis(graph, inputs, again, lambda: inputs)
                kept = reference.output
                try:
                    self.compare(
                        graph, inputs, lambda: kept, message=DUMMY_MISMATCH, timings=timings, diagnose=diagnose
                    )
                except CaptureError:
                    if not reference.first:
                        raise
                    inputs = self.parts.stage(batch, key, phase="capture", dummy=True)
                else:
                    timings["eager"] = reference.seconds
                    return 0.0  # counted with the warmups
            run = recorder.reference_run(inputs, mode)
            eager = lambda: outputs.real(run(), inputs)  # noqa: E731
            diagnose = self.diagnosis(graph, inputs, eager, lambda: inputs)
            return self.compare(graph, inputs, eager, message=DUMMY_MISMATCH, timings=timings, diagnose=diagnose)

    def fills(self, key: GraphKey, graph: CapturedGraph) -> tuple[float, tuple[Fill, ...]]:
        """Verify `key` on a probe batch at each of `probe_fills(key)`; the eager seconds and the fills."""
        parts, references = self.parts, self.references
        kv, shape = parts.config.kv_cache, parts.registry.capture_shape(key)
        probes = key_probes(shape, max_model_len=kv.max_model_len, piecewise=key.piecewise)
        seconds = 0.0
        # An engine's own sampler may name state the step writes (a float buffer's default sampling names nothing).
        own = any(spec.sample is not None and spec.sample != "pad" for spec in parts.extras)
        for fill, made in probes:
            probe = references.batches.get(made)
            if probe is None:
                batch, writes = probe_batch(
                    shape,
                    max_model_len=kv.max_model_len,
                    block_size=kv.block_size,
                    num_blocks=kv.num_blocks,
                    vocab_size=parts.config.model.vocab_size,
                    scratch_blocks=self.scratch.blocks,
                    groups=parts.kv_groups,
                    group_scratch=self.scratch.groups,
                    fill=fill,
                    own=own,
                    seed=int(key.piecewise),  # a piecewise key's batches are not a full key's of its shape
                )
                probe = (self.recorder.sampled(batch, 1, dict(key.axes)), writes)
                if not (writes or own):  # a batch that writes is the key's own (`probe_batch`): never shared
                    references.batches[made] = probe
            if probe[1] or own:
                seconds += self.batch(key, graph, *probe)
                references.done(key, made)
            else:
                seconds += self.batch(key, graph, *probe, made=made)
        return seconds, tuple(fill for fill, _ in probes)

    def batch(
        self, key: GraphKey, graph: CapturedGraph, batch: StepBatch, writes: bool, *, made: tuple | None = None
    ) -> float:
        """Replay `batch` (a probe) on `key`'s graph against an eager run of it at its own counts; `made`: the
        batch's identity in the pass (`expected_probes`), whose eager result is then shared with the pass's later
        probes of it."""
        parts, references = self.parts, self.references
        num_reqs = capture_reqs(parts.registry, key)
        counts = f"a probe batch of {batch.num_tokens} tokens and {batch.num_reqs} requests"
        with failing_in("the verification", counts):
            stage = lambda: parts.stage(batch, key, phase="capture", dummy=True, kv_writes=writes)  # noqa: E731
            inputs = stage()
            phase: Phase = "eager" if parts.registry.mode_of(key) is Mode.PIECEWISE else "full"
            eager = self._eager_at(batch, parts.registry.axis_values(batch.axes), phase, writes)
            message = probe_mismatch(batch.num_tokens, batch.num_reqs, key.num_tokens, num_reqs, writes)
            fingerprint = batch_fingerprint(batch, phase, writes) if references.enabled and made is not None else None
            kept = references.get(fingerprint)
            if kept is not None and made is not None:
                try:
                    self.compare(graph, inputs, lambda: kept, message=message)
                except CaptureError:  # a fresh eager run decides, as with nothing kept
                    inputs = stage()
                else:
                    references.hits += 1
                    references.done(key, made)
                    return 0.0
            result: list[StepOutput] = []

            def fresh() -> StepOutput:
                result.append(eager())
                return result[-1]

            diagnose = self.diagnosis(graph, inputs, eager, stage)
            seconds = self.compare(graph, inputs, fresh, message=message, diagnose=diagnose)
            if made is not None:
                references.keep(fingerprint, result[0], made)
                references.done(key, made)
            return seconds

    def axes(self, key: GraphKey, graph: CapturedGraph) -> float:
        """Replay `key`'s dummy batch stating lower axis values (`lowered_axes`: padded axis slots) against an eager
        run at those values; the eager seconds, 0 for a key with nothing to lower. `ReplayMismatchError` naming the
        axis when they differ: a step pads each axis to the smallest captured value at or above its own, so the
        slots beyond its value run in the graph with nothing real in them and must leave every real row unchanged.
        """
        parts = self.parts
        axes = lowered_axes(parts.registry, key)
        if axes is None:
            return 0.0
        shape = parts.registry.capture_shape(key)
        batch = self.recorder.sampled(
            dummy_batch(shape, max_model_len=parts.config.kv_cache.max_model_len), 2, dict(axes)
        )
        shown = ", ".join(f"{name} {value}" for name, value in axes)
        with failing_in("the verification", f"{dummy_counts(batch)} stating {shown}"):
            inputs = parts.stage(batch, key, phase="capture", dummy=True)
            phase: Phase = "eager" if parts.registry.mode_of(key) is Mode.PIECEWISE else "full"
            return self.compare(graph, inputs, self._eager_at(batch, axes, phase), message=axes_mismatch(key, axes))

    def timed(self, verified: Verified) -> Verified:
        """Time the key's replay against an eager run of its dummy batch (`replay_speedup`: the medians of a
        few interleaved runs) into `speedup`; run when `capture.min_speedup` is set (without it, `speedup`
        is the one sample of each side the dummy batch's verification took). Below `capture.min_speedup` (on
        any data-parallel rank) the key comes back skipped, eager reason `no_speedup`, its graph released.
        """
        with in_phase("verify"):  # graphcap's dummy batch, replayed and run eagerly
            return self._timed(verified)

    def _timed(self, verified: Verified) -> Verified:
        outcome, graph = verified
        if graph is None:
            return verified
        key, parts = outcome.key, self.parts
        inputs = self.recorder.stage_dummy(key)
        eager = self.recorder.reference_run(inputs, parts.registry.mode_of(key))

        def replay() -> None:
            with running(inputs):
                graph.replay()

        with torch.inference_mode():
            speedup = replay_speedup(replay, eager, parts.backend, timer=self.timer)
        least, peers = parts.config.capture.min_speedup, parts.failures.peers
        slow, peer = least is not None and speedup < least, False
        if least is not None and peers is not None:  # ranks keep the same keys: one slow rank drops it everywhere
            first = peers.first_failed(slow, "key", f"{key}: capture.min_speedup")
            slow, peer = first is not None, first is not None and not slow
        if not slow:
            return Verified(dataclasses.replace(outcome, speedup=speedup), graph)
        why = "another data-parallel rank's replay was" if peer else f"replay {speedup:.2f}x as fast as eager,"
        message = f"no_speedup: {why} below capture.min_speedup {least:g} (the graph was released)"
        graph.release()
        return Verified(outcome.skipped(message, "no_speedup", speedup=speedup), None)

    def compare(self, graph: CapturedGraph, inputs: ForwardInputs, eager: Eager, **options: Any) -> float:
        """`compare_replay` at this pass's tolerance, backend, output rows and precision; `options`: its
        `message`, `timings` and `diagnose`."""
        parts = self.parts
        tolerance, backend, outputs = parts.config.checks.tolerance, parts.backend, parts.outputs
        return compare_replay(
            graph,
            inputs,
            eager,
            tolerance=tolerance,
            backend=backend,
            outputs=outputs,
            precision=self.precision,
            **options,
        )

    def _eager_at(
        self, batch: StepBatch, axes: tuple[tuple[str, int], ...], phase: Phase, writes: bool = True
    ) -> Eager:
        """An eager run of `batch` at its own counts and `axes`, on the graph's code path (`phase`: full graphs ran
        capturable stand-ins), cut to its real rows."""
        parts, forward = self.parts, self.recorder.forward

        def eager() -> StepOutput:
            eager_key = parts.registry.eager_key(batch.num_tokens, batch.num_reqs, axes)
            eager_inputs = parts.stage(batch, eager_key, phase="eager", dummy=True, kv_writes=writes)
            with running(eager_inputs, phase):
                return parts.outputs.real(forward(eager_inputs), eager_inputs)

        return eager

    def diagnosis(
        self, graph: CapturedGraph, inputs: ForwardInputs, eager: Eager, stage: Callable[[], ForwardInputs]
    ) -> Diagnose | None:
        """What `compare_replay` asks when a replay of the staged `inputs` and an eager run differ: whether the
        forward carries state between runs (`carried_state`), and which tensors it changed (not staged, not
        weights). None with data- or tensor-parallel peers: the runs it adds may hold collectives that peers whose
        comparison passed would not join.
        """
        parts = self.parts
        if parts.failures.peers is not None:
            return None

        def replay_again() -> StepOutput:
            staged = stage()
            with running(staged):
                return parts.outputs.real(cloned(graph.replay()), staged)

        def diagnose(replayed: Any, expected: Any) -> str | None:
            hint = domain_hint(
                parts.extras, flatten_output(replayed, "replay")[0], flatten_output(expected, "eager")[0]
            )
            if hint is not None:
                return hint
            staged = set(inputs.tensors())
            state = {
                name: tensor
                for name, tensor in parts.static_inputs(inputs).items()
                if name not in staged and not isinstance(tensor, torch.nn.Parameter)
            }
            T, R = inputs.key.num_tokens, inputs.key.num_reqs
            counts = f"{inputs.num_tokens} of {T} tokens, {inputs.num_reqs} of {R or inputs.num_reqs} requests real"
            with torch.inference_mode():
                return carried_state(
                    state,
                    eager_again=eager,
                    replay_again=replay_again,
                    differ=differs(parts.config.checks.tolerance, self.precision),
                    first=(replayed, expected),
                    batch=counts,
                )

        return diagnose


def lowered_axes(registry: KeyRegistry, key: GraphKey) -> tuple[tuple[str, int], ...] | None:
    """`key.axes` with every axis whose value has one below it lowered: to the axis's smallest captured value
    when that is below the key's (the most padded slots), else by one. None when no axis can be lowered."""
    out, lowered = [], False
    for name, value in key.axes:
        floor = registry.axes[name][0]
        below = floor if floor < value else value - 1
        if below >= 0:
            out.append((name, below))
            lowered = True
        else:
            out.append((name, value))
    return tuple(out) if lowered else None
