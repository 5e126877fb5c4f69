"""graphcap: capture and replay CUDA graphs for LLM inference, with the padded tail proven right.

Layers, low to high: `PersistentBuffers.stage` + `check_invariants` (fill and prove the static
inputs), the graph backends (`graphcap.backends`: capture one callable), and `CaptureManager`
(capture every padded size, dispatch each step, replay or run eagerly).
"""

from graphcap.backends import CaptureError, CaptureUnsafeError
from graphcap.batch import GraphKey, StepBatch, dummy_batch
from graphcap.buffers import PAD_SLOT_ID, ForwardInputs, PadRules, PersistentBuffers
from graphcap.config import CaptureConfig, ConfigError, load_config
from graphcap.invariants import InvariantViolation, check_invariants
from graphcap.manager import CaptureManager
from graphcap.report import CaptureReport
from graphcap.sizes import CaptureSizes, default_capture_sizes

__version__ = "0.1.0"

__all__ = [
    "PAD_SLOT_ID",
    "CaptureConfig",
    "CaptureError",
    "CaptureManager",
    "CaptureReport",
    "CaptureUnsafeError",
    "CaptureSizes",
    "ConfigError",
    "ForwardInputs",
    "GraphKey",
    "InvariantViolation",
    "PadRules",
    "PersistentBuffers",
    "StepBatch",
    "check_invariants",
    "default_capture_sizes",
    "dummy_batch",
    "load_config",
]
