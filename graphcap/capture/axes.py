"""Verification of key axes (`capture.axes`): padded axis slots must be neutral, as padded rows are.

A step pads each axis to the smallest captured value at or above its own, so a graph captured at
`lora=4` also serves steps of 3 adapters (and, with data-parallel peers, of fewer: every rank replays
the agreed combination). The slots beyond a step's value run in the graph with nothing real in them:
they must leave every real output row unchanged. `CapturePass` replays each key's dummy batch stating
lower axis values (`lowered_axes`) and compares with an eager run at those values; a model whose padded
slots leak into real rows is refused at capture, naming the axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphcap.backends import CapturedGraph
from graphcap.batch import dummy_batch
from graphcap.keys import GraphKey, KeyRegistry, Mode
from graphcap.piecewise import running

__all__ = ["axes_mismatch", "lowered_axes", "verify_axes"]


def verify_axes(job: Any, key: GraphKey, graph: CapturedGraph) -> float:
    """Replay `key`'s dummy batch stating lower axis values (`lowered_axes`: padded axis slots) against an eager
    run at those values (`job`: the `CapturePass`); returns the eager seconds, 0 for a key with nothing to lower.
    `CaptureError` naming the axis when they differ."""
    axes = lowered_axes(job.registry, key)
    if axes is None:
        return 0.0
    shape = job.registry.capture_shape(key)
    batch = job._sampled(dummy_batch(shape, max_model_len=job.config.kv_cache.max_model_len), 2, dict(axes))
    inputs = job.stage(batch, key, phase="capture", dummy=True)
    phase = "eager" if job.registry.mode_of(key) is Mode.PIECEWISE else "full"

    def eager() -> Any:
        eager_key = job.registry.eager_key(batch.num_tokens, batch.num_reqs, axes)
        eager_inputs = job.stage(batch, eager_key, phase="eager", dummy=True)
        with running(eager_inputs, phase):  # the graph's code path: full graphs ran capturable stand-ins
            return job.outputs.real(job.forward(eager_inputs), eager_inputs)

    return job.compare(
        graph,
        inputs,
        eager,
        message=axes_mismatch(key, axes),
    )


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


def axes_mismatch(key: GraphKey, lowered: tuple[tuple[str, int], ...]) -> Callable[[str], str]:
    """The message of a key whose replay at `lowered` axis values differs from eager at those values."""
    changed = [(name, dict(key.axes)[name], value) for name, value in lowered if value != dict(key.axes)[name]]
    shown = ", ".join(f"{name} {value} (the graph holds {held})" for name, held, value in changed)
    names = ", ".join(name for name, _, _ in changed)
    return lambda diff: (
        f"replay of {key} differs from eager on its dummy batch stating capture.axes {shown}: {diff}. The model "
        f"is not neutral to padded {names} slots: a step pads each axis up to a captured value, so the slots "
        f"beyond its own value run in the graph and must leave every real row unchanged (mask them, as padded "
        f"rows are masked: e.g. an adapter slot no token uses must add nothing)"
    )
