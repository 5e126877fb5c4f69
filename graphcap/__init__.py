"""graphcap: capture and replay CUDA graphs for LLM inference, with the padded tail proven right.

Layers, low to high: `PersistentBuffers.stage` + `check_invariants` (fill and prove the static
inputs), the graph backends (`graphcap.backends`: capture one callable), and `CaptureManager`
(capture every padded size, dispatch each step, replay or run eagerly). Most engines use only
`CaptureManager`, `StepBatch`, `load_config` and, for their own buffers, `BufferSpec`; engines
that keep a persistent block table write its rows through `CaptureManager.block_table`
(`BlockTable`); models that run parts eagerly between graph pieces use `eager_op` and
`current_inputs`; models and communicators that act differently while a graph records ask
`is_capturing()` and `phase()`, and engines pass their communicators as `Communicator`s and their
data- and tensor-parallel groups as one `Parallel`.

The names below load on first use: `import graphcap` alone imports neither torch nor numpy,
so the `graphcap` command starts in milliseconds (`--help`, `--version`, `validate` never
import torch) and a Ctrl-C at start-up lands in its handler, not in a half-imported torch.
`graphcap.__version__` comes from the installed package's metadata (pyproject.toml is the
one place it is written).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name loads on first use
    from graphcap.batch import StepBatch, dummy_batch
    from graphcap.block_table import BlockTable
    from graphcap.checks.invariants import check_invariants
    from graphcap.communicators import Communicator
    from graphcap.config import PAD_SLOT_ID, CaptureConfig, PadRules, load_config
    from graphcap.distributed.options import Parallel
    from graphcap.errors import (
        BatchError,
        CaptureError,
        CaptureUnsafeError,
        ConfigError,
        InvariantViolation,
        ReplayMismatchError,
        StaticInputMovedError,
    )
    from graphcap.inputs import BufferSpec, ForwardInputs
    from graphcap.keys.key import GraphKey
    from graphcap.manager import CaptureManager
    from graphcap.phases import is_capturing, phase
    from graphcap.piecewise import current_inputs, eager_op
    from graphcap.report import CaptureReport
    from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes
    from graphcap.staging import PersistentBuffers

_EXPORTS = {
    "StepBatch": "graphcap.batch",
    "dummy_batch": "graphcap.batch",
    "BlockTable": "graphcap.block_table",
    "Communicator": "graphcap.communicators",
    "PAD_SLOT_ID": "graphcap.config.sections",
    "CaptureConfig": "graphcap.config.root",
    "PadRules": "graphcap.config.sections",
    "load_config": "graphcap.config._load",
    "Parallel": "graphcap.distributed.options",
    "BatchError": "graphcap.errors",
    "CaptureError": "graphcap.errors",
    "CaptureUnsafeError": "graphcap.errors",
    "ConfigError": "graphcap.errors",
    "InvariantViolation": "graphcap.errors",
    "ReplayMismatchError": "graphcap.errors",
    "StaticInputMovedError": "graphcap.errors",
    "BufferSpec": "graphcap.inputs",
    "ForwardInputs": "graphcap.inputs",
    "check_invariants": "graphcap.checks.invariants",
    "GraphKey": "graphcap.keys.key",
    "CaptureManager": "graphcap.manager",
    "is_capturing": "graphcap.phases",
    "phase": "graphcap.phases",
    "current_inputs": "graphcap.piecewise",
    "eager_op": "graphcap.piecewise",
    "CaptureReport": "graphcap.report",
    "CaptureSizes": "graphcap.sizing.sizes",
    "default_capture_sizes": "graphcap.sizing.sizes",
    "PersistentBuffers": "graphcap.staging.buffers",
}
"""Public name -> the module that defines it: the list `__all__` and the imports above must match."""

__all__ = [  # the same names as _EXPORTS (tests/test_packaging.py holds them equal)
    # What engines use: the manager, a step, the config, their parallel peers, their own buffers and block
    # table, errors.
    "CaptureManager",
    "Parallel",
    "StepBatch",
    "load_config",
    "CaptureConfig",
    "BufferSpec",
    "BlockTable",
    "CaptureReport",
    "ForwardInputs",
    "BatchError",
    "CaptureError",
    "CaptureUnsafeError",
    "ConfigError",
    "InvariantViolation",
    "ReplayMismatchError",
    "StaticInputMovedError",
    # What models and communicators call while a step or a capture runs.
    "Communicator",
    "current_inputs",
    "eager_op",
    "is_capturing",
    "phase",
    # Lower layers, under the manager (typically you don't call these yourself): staging and its
    # checks, the key and size schedule, the pad rules and the dummy batch.
    "PersistentBuffers",
    "check_invariants",
    "CaptureSizes",
    "default_capture_sizes",
    "GraphKey",
    "PadRules",
    "PAD_SLOT_ID",
    "dummy_batch",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = importlib.import_module("graphcap.version").version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'graphcap' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
