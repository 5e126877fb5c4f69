"""`no_torch_function()`: graphcap's own per-step torch calls, with torch's Python dispatch off.

Engines keep torch function modes on while they serve: `torch.set_default_device("cuda")` for the whole
process (nano-vllm), `torch.device(...)` and dtype context managers (vLLM, SGLang). Under one, every torch
call, even `Tensor.data_ptr` or a slice, goes through the mode's Python `__torch_function__`, a few
microseconds each. The per-step host path of a replayed step (staging and the invariants, which work on
numpy host arrays; the static guard's sweeps, the upload, the emulated replay of a full graph, the output
cut) makes its few torch calls inside `no_torch_function()`, so a mode costs it nothing and sees none of
them. Never around the model's own code (`prepare`, `forward`, `eager_op` functions): those run under the
engine's modes, as the engine expects (inside, `torch.zeros` would not get the engine's default device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

__all__ = ["TORCH_FUNCTION_OFF", "no_torch_function"]


def _pick() -> tuple[Callable[[], AbstractContextManager], bool]:
    # torch >= 2.0: DisableTorchFunction turns off modes and subclasses alike (DisableTorchFunctionSubclass
    # leaves modes on, so it is no help here).
    disable = getattr(torch._C, "DisableTorchFunction", None)
    if disable is None:  # pragma: no cover - every supported torch has it
        return contextlib.nullcontext, False
    return disable, True


no_torch_function, TORCH_FUNCTION_OFF = _pick()
"""`with no_torch_function():` runs torch calls with torch function modes and subclasses off;
`TORCH_FUNCTION_OFF` says whether this torch can (False: a no-op context)."""
