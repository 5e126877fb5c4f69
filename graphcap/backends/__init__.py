"""Graph backends: capture a forward closure once, replay it many times.

`cuda` wraps `torch.cuda.CUDAGraph` (one shared memory pool per device, capture on a
side stream); `emulated` reproduces CUDA-graph semantics on the CPU by recording and
replaying the aten op tape, so every rule above the backends is tested without a GPU.
Both refuse ops a CUDA graph cannot hold (`graphcap.backends.unsafe`) with
`CaptureUnsafeError`. Pick one with `get_backend`.
"""

from __future__ import annotations

import torch

from graphcap.backends.base import (
    CapturedGraph,
    CaptureError,
    CaptureUnsafeError,
    GraphBackend,
    StaticInputMovedError,
)
from graphcap.backends.emulated import EmulatedBackend, EmulatedGraph
from graphcap.backends.unsafe import UNSAFE_OPS, UnsafeOp

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
]

BACKEND_NAMES = ("auto", "cuda", "emulated")
"""Valid `name`s for `get_backend`."""


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
