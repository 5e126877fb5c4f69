"""Graph backends: capture a forward closure once, replay it many times.

`cuda` wraps `torch.cuda.CUDAGraph` (one shared memory pool per device, capture on a
side stream); `emulated` reproduces CUDA-graph semantics on the CPU by recording and
replaying the aten op tape, so every rule above the backends is tested without a GPU.
Both refuse ops a CUDA graph cannot hold (`graphcap.backends.unsafe`) with
`CaptureUnsafeError`. Pick one with `get_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphcap.backends.base import CapturedGraph, GraphBackend
from graphcap.backends.emulated import EmulatedBackend, EmulatedGraph
from graphcap.backends.unsafe import UNSAFE_OPS, UnsafeOp
from graphcap.config.sections import BACKEND_NAMES  # defined with the config's choices: torch-free
from graphcap.errors import CaptureError, CaptureUnsafeError, ConfigError, ConfigProblem, StaticInputMovedError

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig

__all__ = [
    "BACKEND_NAMES",
    "UNSAFE_OPS",
    "CaptureError",
    "CaptureUnsafeError",
    "CapturedGraph",
    "EmulatedBackend",
    "EmulatedGraph",
    "GraphBackend",
    "StaticInputMovedError",
    "UnsafeOp",
    "get_backend",
    "resolve_device",
]


def get_backend(name: str, device: torch.device | str, *, sync_debug: bool = False) -> GraphBackend:
    """Build the backend called `name` ("auto" | "cuda" | "emulated") for `device`.

    "auto" is "cuda" when CUDA is available and `device` is a CUDA device, else
    "emulated". `sync_debug` (cuda only) runs warmups under
    `torch.cuda.set_sync_debug_mode("error")`, so any host sync is named before capture.
    """
    if name not in BACKEND_NAMES:
        valid = ", ".join(BACKEND_NAMES)
        raise ValueError(f"unknown graph backend {name!r}; valid choices: {valid}")
    device = torch.device(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and device.type == "cuda" else "emulated"
    if name == "emulated":
        return EmulatedBackend(device)
    from graphcap.backends.cuda import CUDAGraphBackend  # touches torch.cuda only when asked

    return CUDAGraphBackend(device, sync_debug=sync_debug)


def resolve_device(config: CaptureConfig | str) -> torch.device:
    """The `torch.device` that `config.device` (or a device string) names.

    `auto` is cuda when available, else cpu. Raises `ConfigError` (key `device`) when cuda
    is requested and unavailable, or when `cuda:N` names a GPU that does not exist.
    """
    requested = config if isinstance(config, str) else config.device
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        message = (
            f"{requested!r} requested but CUDA is not available (torch {torch.__version__}, {built}); "
            "use device: cpu or auto"
        )
        raise ConfigError([ConfigProblem("device", message)])
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        message = (
            f"{requested!r} names GPU {device.index} but {count} visible; use cuda:0 to cuda:{count - 1}, "
            "or check CUDA_VISIBLE_DEVICES"
        )
        raise ConfigError([ConfigProblem("device", message)])
    return device
