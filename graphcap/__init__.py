"""graphcap: capture and replay CUDA graphs for LLM inference, with the padded tail proven right.

Layers, low to high: `PersistentBuffers.stage` + `check_invariants` (fill and prove the static
inputs), the graph backends (`graphcap.backends`: capture one callable), and `CaptureManager`
(capture every padded size, dispatch each step, replay or run eagerly). Most engines use only
`CaptureManager`, `StepBatch`, `load_config` and, for their own buffers, `BufferSpec`; engines
that keep a persistent block table write its rows through `CaptureManager.block_table`
(`BlockTable`).
"""

from graphcap.batch import GraphKey, StepBatch, dummy_batch
from graphcap.block_table import BlockTable
from graphcap.buffers import PAD_SLOT_ID, ForwardInputs, PadRules, PersistentBuffers
from graphcap.config import CaptureConfig, load_config
from graphcap.errors import (
    BatchError,
    CaptureError,
    CaptureUnsafeError,
    ConfigError,
    InvariantViolation,
    StaticInputMovedError,
)
from graphcap.inputs import BufferSpec
from graphcap.invariants import check_invariants
from graphcap.manager import CaptureManager
from graphcap.piecewise import current_inputs, eager_op
from graphcap.report import CaptureReport
from graphcap.sizes import CaptureSizes, default_capture_sizes

__version__ = "0.1.0"

__all__ = [
    "PAD_SLOT_ID",
    "BatchError",
    "BlockTable",
    "BufferSpec",
    "CaptureConfig",
    "CaptureError",
    "CaptureManager",
    "CaptureReport",
    "CaptureSizes",
    "CaptureUnsafeError",
    "ConfigError",
    "ForwardInputs",
    "GraphKey",
    "InvariantViolation",
    "PadRules",
    "PersistentBuffers",
    "StaticInputMovedError",
    "StepBatch",
    "check_invariants",
    "current_inputs",
    "default_capture_sizes",
    "dummy_batch",
    "eager_op",
    "load_config",
]
