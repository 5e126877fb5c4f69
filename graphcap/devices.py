"""Device and backend names as a config and the command line spell them (a torch-free leaf).

The command line builds its parser from these names without importing the config package or
torch, so `graphcap --help` stays cheap; `graphcap.config` checks `device` with `device_problem`,
and `graphcap.backends` resolves a valid name to a `torch.device`.
"""

from __future__ import annotations

import re

__all__ = ["BACKEND_NAMES", "CAPTURE_ERROR_MODES", "MAX_DEVICE_INDEX", "device_problem"]

BACKEND_NAMES = ("auto", "cuda", "emulated")
"""Names `graphcap.backends.get_backend` and `graphcap --backend` accept."""

CAPTURE_ERROR_MODES = ("thread_local", "global", "relaxed")
"""`capture.capture_error_mode` values, given to `CUDAGraph.capture_begin`; the first is the default."""

MAX_DEVICE_INDEX = 127
"""Largest `N` of `cuda:N`. torch keeps a device index in 8 bits: `torch.device("cuda:128")` is
`cuda:-128`, `cuda:255` is plain `cuda` and larger numbers wrap or fail to parse."""

_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def device_problem(device: str) -> str | None:
    """What is wrong with a `device` value (None: nothing). Whether the GPU exists is checked
    later, where torch is imported (`graphcap.backends.resolve_device`)."""
    match = _DEVICE.fullmatch(device)
    if match is None:
        return f"must be auto, cpu, cuda or cuda:N; got {device!r}"
    index = match.group(1)
    if index is not None and (len(index) > 3 or int(index) > MAX_DEVICE_INDEX):
        shown = index if len(index) <= 12 else index[:9] + "..."
        return f"cuda:{shown} is not a device index torch can hold (0..{MAX_DEVICE_INDEX}); use cuda:N for GPU N"
    return None
