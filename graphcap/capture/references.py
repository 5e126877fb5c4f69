"""`SharedReferences`: the eager results of a pass's probe batches, kept for the later keys that probe them again.

A probe batch that writes nothing depends on its real counts, not on the key it probes (`probe_batch`), so
keys of one pass probe the same batches: one token for every key, uniform and mixed keys of one size alike.
Its eager result is computed once per pass and kept until the pass's last probe of it; every key's replay is
still compared with it, and a replay that differs from a kept result is compared again with a fresh eager run,
whose verdict stands (`graphcap.capture.verifier`), so keeping a result never decides a comparison.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from graphcap.batch import StepBatch
from graphcap.keys import GraphKey, KeyRegistry
from graphcap.outputs import StepOutput, flatten_output
from graphcap.probe import REFERENCE_BYTES, Fill, probe_fills, probes_of

__all__ = ["SharedReferences", "batch_fingerprint", "expected_probes", "in_world", "key_probes"]


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
        self.kept: dict[tuple, StepOutput] = {}
        self.bytes = 0
        self.hits = 0
        """Eager runs not repeated: probes whose reference was kept."""
        self.batches: dict[tuple, tuple[StepBatch, bool]] = {}
        """The pass's probe batches (sampled, and whether they write), by `expected_probes`' identity: made once."""
        self._held: dict[tuple, list[tuple[tuple, int]]] = {}  # batch -> [(fingerprint, bytes)] kept for it
        self._left: dict[GraphKey, Counter] = {}  # key -> its probes still to come, by batch

    @classmethod
    def for_pass(cls, peers: object | None, ledger: object | None) -> SharedReferences:
        """A pass's references: on for a process alone (no peers, no ledger, not one rank of several)."""
        return cls(peers is None and ledger is None and not in_world())

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

    def get(self, fingerprint: tuple | None) -> StepOutput | None:
        """The kept result of the batch `fingerprint` names, or None."""
        if fingerprint is None or not self.enabled:
            return None
        return self.kept.get(fingerprint)

    def keep(self, fingerprint: tuple | None, output: StepOutput, made: tuple) -> None:
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


def expected_probes(
    registry: KeyRegistry, keys: Iterable[GraphKey], *, max_model_len: int
) -> dict[GraphKey, list[tuple]]:
    """Per key, the batch identity of every probe that verifying it runs (`graphcap.probe.probes_of`)."""
    probes = {}
    for key in keys:
        shape = registry.capture_shape(key)
        probes[key] = [made for _, made in key_probes(shape, max_model_len=max_model_len, piecewise=key.piecewise)]
    return probes


def key_probes(shape: GraphKey, *, max_model_len: int, piecewise: bool) -> list[tuple[Fill, tuple]]:
    """The probes verifying a key of capture shape `shape` runs: each of `probe_fills(shape)` with its batch's
    identity in the pass (`graphcap.probe.probes_of`)."""
    return probes_of(shape, probe_fills(shape, max_model_len=max_model_len), piecewise=piecewise)


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


def in_world() -> bool:
    """Whether this process is one rank of several (`torch.distributed`, initialized, more than one rank)."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1
