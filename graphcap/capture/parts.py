"""`CaptureParts`: what a capture pass needs from its manager, typed, built once when the manager is.

The manager builds one at construction and hands it to its `Capturer`; every stage of a pass (the recorder,
the verifier, the pass loop) reads what it needs from it. `model`, `config`, `forward` and `ledger` are the
manager's own (`CaptureManager.model`, `.config`, ... read and write them here), so what the manager changes
later (`resize_kv`'s config) a later pass sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from graphcap.backends import GraphBackend
from graphcap.batch import StepBatch
from graphcap.capture.failures import FailurePolicy
from graphcap.capture.lazy import LazyCapture
from graphcap.capture.lifecycle import KeptOutputs, LiveGraphs, PassHistory
from graphcap.checks.guard import StaticGuard
from graphcap.communicators import Communicator
from graphcap.config import CaptureConfig
from graphcap.inputs import BufferSpec, ForwardInputs, KVGroup, PreparePhase
from graphcap.keys import GraphKey, KeyRegistry, StepStats
from graphcap.memory.budget import MemoryBudget
from graphcap.outputs import OutputRows, StepOutput
from graphcap.staging import PersistentBuffers
from graphcap.step_scope import StepScope

if TYPE_CHECKING:  # distributed/ sits beside capture/; only the annotations need it
    from graphcap.distributed.ledger import CollectiveLedger
    from graphcap.distributed.step import StepAgreement

__all__ = ["CaptureParts", "Forward", "PartOf", "Stage"]

T = TypeVar("T")

Forward = Callable[[ForwardInputs], StepOutput]
"""The model's forward: staged inputs in, its result out."""


class Stage(Protocol):
    """The manager's one staging path (`CaptureManager._stage`): stage, the model's `prepare`, the invariants,
    the upload."""

    def __call__(
        self, batch: StepBatch, key: GraphKey, *, phase: PreparePhase, dummy: bool = False, kv_writes: bool = True
    ) -> ForwardInputs: ...


@dataclass(eq=False)
class CaptureParts:
    """Everything a capture pass reads or writes beyond its own keys, built once per manager."""

    model: Any
    """The engine's model (`CaptureManager.model`)."""
    config: CaptureConfig
    """The manager's config (`CaptureManager.config`: `resize_kv` replaces it)."""
    forward: Forward
    """The model's forward (`CaptureManager._forward`)."""
    stage: Stage
    registry: KeyRegistry
    backend: GraphBackend
    device: torch.device
    """The manager's device (`CaptureManager.device`), named in reports."""
    buffers: PersistentBuffers
    outputs: OutputRows
    """The model's `output_rows`, which cut every result compared."""
    guard: StaticGuard
    live: LiveGraphs
    budget: MemoryBudget
    lazy: LazyCapture
    history: PassHistory
    kept: KeptOutputs
    stats: StepStats
    scope: StepScope
    failures: FailurePolicy
    peers: StepAgreement | None
    """The data- and tensor-parallel peers (None: none)."""
    ledger: CollectiveLedger | None
    """With peers (not on CUDA), each key's capture and verification is one of its segments, so a rank failing
    part-way issues what its peers still wait in before the key's agreement."""
    communicators: tuple[Communicator, ...]
    context: Callable[[], AbstractContextManager[Any]]
    """Entered around a pass's captures; verification runs after it exits (an engine's `graph_capture()`)."""
    progress: bool | None
    """A progress bar on stderr (None: when stderr is a terminal)."""

    @property
    def extras(self) -> tuple[BufferSpec, ...]:
        """The engine buffers (`BufferSpec`s) the staging path fills."""
        return self.buffers.extras

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The extra KV-cache groups (`kv_cache.groups`)."""
        return self.buffers.limits.kv_groups

    def capture_forward(self) -> Forward:
        """The forward a pass runs: the model's, inside the ledger's segments where there is one."""
        forward, ledger = self.forward, self.ledger
        return forward if ledger is None else ledger.wrap(forward)

    def static_inputs(self, inputs: ForwardInputs) -> dict[str, torch.Tensor]:
        """Every tensor a graph of `inputs` reads, by name (the model's, the registered statics, the buffers)."""
        return self.guard.collect(self.model, inputs.tensors())

    def segment(self) -> AbstractContextManager[Any]:
        """The ledger's segment around one key's capture or verification (nothing without a ledger)."""
        return self.ledger.segment() if self.ledger is not None else contextlib.nullcontext()


class PartOf(Generic[T]):
    """An attribute of the manager that is its `CaptureParts`' field `name` (`owner._parts`), read and written there:
    one place, so a pass reads what the manager (or an engine, or a test) set."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, owner: Any, kind: type | None = None) -> T:
        return getattr(owner._parts, self.name)

    def __set__(self, owner: Any, value: T) -> None:
        setattr(owner._parts, self.name, value)
