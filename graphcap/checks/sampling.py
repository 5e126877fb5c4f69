"""`StepSampler`: every Nth replayed step (`checks.sample_every: N`) is checked against an eager run of the batch.

Capture-time verification sees two batches per key. It cannot see a kernel that reads the wrong
slice of a correct buffer only at some live shapes, a host plan `prepare()` computed that goes
stale later, or (on CUDA) an eager op's input whose memory a later capture reused. A sampled step
runs the model eagerly on the same batch before the replay, then compares the replay's real
output rows and the KV slots the step's real tokens write with the eager run's
(`ReplayMismatchError` naming the key, the replayed-step count and what differs).

The eager run must leave nothing of its own in what the engine owns. It writes the KV slots of the
step's own tokens, the same slots the replay then writes: their values are read before it
(`snapshot`), after it (the expected values) and put back before the replay, so the replay starts
from the very state an unsampled step would, and a replay that fails to write one of its slots
shows as a difference. Which tensors are KV caches, and how a slot indexes them, graphcap reads
from their shapes (`locate`):

| a tensor the model reaches (not an `nn.Parameter`) with | is a KV cache whose slot `s` is |
|---|---|
| a dim of `num_blocks` (or one more: a scratch block), a later dim of `block_size` | `[.., s // bs, .., s % bs, ..]` |
| else a dim of `num_blocks * block_size` slots (up to `block_size` more) | `[..., s, ...]` |

for the built-in cache (`kv_cache.block_size`, `num_blocks`) and each group of `kv_cache.groups`.
A tensor whose shape fits several of them (a group of the built-in cache's geometry) is compared at
the slots of each, so a replay that drops a group's writes is named with the group; where the runs
agree no set of slots differs. A cache laid out otherwise is not compared (its output still is);
what the eager run writes there the replay overwrites, as it writes the same slots. Other state
the forward changes (a counter, a recurrent state) sees the step twice: sample only models whose
forward writes no state but the KV cache. Cost: nothing on an unsampled step but a counter; a sampled step pays
an eager forward, a second staging and a gather of the step's slots (`tools/bench_sampling.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from graphcap.capture.verification import difference
from graphcap.errors import ReplayMismatchError
from graphcap.inputs import ForwardInputs
from graphcap.outputs import cloned
from graphcap.piecewise import running

__all__ = ["Cache", "Expected", "StepSampler", "locate"]


class Cache(NamedTuple):
    """A KV cache found by `locate`: the tensor by name, which group it belongs to, and how slots index it."""

    name: str
    group: str | None
    """None: the built-in cache (`kv_cache`); else a `kv_cache.groups` name."""
    view: torch.Tensor
    """The tensor with its block and offset dims (or its slot dim) moved first: a view, never a copy."""
    by_block: bool
    """True: `view[block, offset]`; False: `view[slot]`."""
    block_size: int


class Expected(NamedTuple):
    """What the eager run of a sampled step gave: its real output rows and the values of each cache's slots."""

    output: Any
    caches: list[Cache]
    slot_index: list[tuple[torch.Tensor, ...]]
    """Per cache, the index of the real slots (`_gather`)."""
    values: list[torch.Tensor]


def locate(tensors: Mapping[str, torch.Tensor], caches: Sequence[tuple[str | None, int, int]]) -> list[Cache]:
    """The KV caches among `tensors` (see the module table); `caches`: `(group, block_size, num_blocks)` each.

    A tensor listed twice (a view and its base at the same place) is taken once; a tensor is found once for
    each cache whose shape it fits (the built-in cache and a group of its geometry: no shape tells them apart),
    so it is compared at each one's slots.
    """
    found, seen = [], set()
    for name, tensor in tensors.items():
        if isinstance(tensor, nn.Parameter) or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            continue
        place = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if place in seen:
            continue
        for group, block_size, num_blocks in caches:
            cache = _fit(name, tensor, group, block_size, num_blocks)
            if cache is not None:
                seen.add(place)
                found.append(cache)
    return found


def _fit(name: str, tensor: torch.Tensor, group: str | None, block_size: int, num_blocks: int) -> Cache | None:
    shape = tuple(tensor.shape)
    for d, size in enumerate(shape):
        if size in (num_blocks, num_blocks + 1) and block_size in shape[d + 1 :]:
            e = shape.index(block_size, d + 1)
            return Cache(name, group, tensor.movedim((d, e), (0, 1)), True, block_size)
    slots = num_blocks * block_size
    for d, size in enumerate(shape):
        if slots <= size <= slots + block_size:
            return Cache(name, group, tensor.movedim(d, 0), False, block_size)
    return None


class StepSampler:
    """Counts replayed steps and checks every `every`th one (`due`, `eager`, `compare`); one per manager."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.replays = 0
        """Replayed steps so far (the step a `ReplayMismatchError` names)."""
        self.checked = 0
        """Sampled steps compared so far."""

    def due(self) -> bool:
        """Count one replayed step; True when this one is sampled."""
        self.replays += 1
        return self.replays % self.every == 0

    def eager(
        self,
        inputs: ForwardInputs,
        forward: Callable[[ForwardInputs], Any],
        real: Callable[[Any], Any],
        caches: list[Cache],
    ) -> Expected:
        """Run `forward` on the eagerly staged `inputs`; its real rows (`real`) and slots, the slots then put back."""
        index = [_index(cache, _slots(inputs, cache.group)) for cache in caches]
        before = _gather(caches, index)
        with torch.inference_mode(), running(inputs):
            output = cloned(real(forward(inputs)))
        values = _gather(caches, index)
        with torch.inference_mode():
            for cache, where, saved in zip(caches, index, before):
                cache.view[where] = saved  # the step's own slots, as they were before it
        return Expected(output, caches, index, values)

    def compare(self, key: Any, replayed: Any, expected: Expected, tolerance: Mapping[str, float], precision: Any):
        """`ReplayMismatchError` when the replay's real rows or KV slots differ from `expected`'s."""
        self.checked += 1
        diff = difference(replayed, expected.output, tolerance, precision)
        what = "its output"
        if diff is None:
            for cache, value, now in zip(
                expected.caches, expected.values, _gather(expected.caches, expected.slot_index)
            ):
                diff = difference(now, value, tolerance, precision)
                if diff is not None:
                    what = f"the KV slots its tokens write in {cache.name!r}" + (
                        f" (kv_cache.groups {cache.group!r})" if cache.group is not None else ""
                    )
                    break
        if diff is not None:
            raise ReplayMismatchError(
                f"checks.sample_every: replayed step {self.replays} (key {key}) differs from an eager run of the same "
                f"batch in {what}: {diff}. The graph no longer computes what the model does on this batch: a kernel "
                "that reads another slice at the padded shape, a host value or plan (prepare()) the graph froze at "
                "capture and that has changed since, or (CUDA) memory an eager op read that a later capture reused. "
                "The KV slots hold the replay's values; capture() again, or run this key eagerly until the model is "
                "fixed",
                key,
                self.replays,
                what,
            )


def _slots(inputs: ForwardInputs, group: str | None) -> np.ndarray:
    n = inputs.num_tokens
    host = inputs.host
    slots = host.slot_mapping[:n] if group is None else host.kv_groups[group].slot_mapping[:n]
    return slots[slots >= 0].astype(np.int64)


def _index(cache: Cache, slots: np.ndarray) -> tuple[torch.Tensor, ...]:
    device = cache.view.device
    if cache.by_block:
        return (
            torch.from_numpy(slots // cache.block_size).to(device),
            torch.from_numpy(slots % cache.block_size).to(device),
        )
    return (torch.from_numpy(slots).to(device),)


def _gather(caches: list[Cache], index: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    return [cache.view[where].clone() for cache, where in zip(caches, index)]
