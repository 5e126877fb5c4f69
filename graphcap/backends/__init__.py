"""Graph backends: capture a forward closure once, replay it many times.

`cuda` wraps `torch.cuda.CUDAGraph` (one memory pool and capture side stream per backend);
`emulated` reproduces CUDA-graph semantics on the CPU by recording and replaying the aten
op tape, so every rule above the backends is tested without a GPU. Both name ops a CUDA
graph cannot hold (`graphcap.backends.unsafe`) with `CaptureUnsafeError`, in a preflight
before capture; `check_capture_safe(fn, device)` runs that preflight on its own. Pick a
backend with `get_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from graphcap.backends.base import GraphBackend
from graphcap.backends.emulated import EmulatedBackend, EmulatedGraph
from graphcap.backends.generators import check_generators
from graphcap.backends.graph import CapturedGraph, is_sticky_cuda_error
from graphcap.backends.pool import GraphPool
from graphcap.backends.preflight import check_capture_safe
from graphcap.backends.unsafe import UNSAFE_OPS, UnsafeOp
from graphcap.devices import BACKEND_NAMES, CAPTURE_ERROR_MODES  # torch-free: the command line reads them
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
    "GraphPool",
    "StaticInputMovedError",
    "UnsafeOp",
    "backend_for",
    "check_capture_safe",
    "get_backend",
    "is_sticky_cuda_error",
    "resolve_device",
]


def get_backend(
    name: str,
    device: torch.device | str,
    *,
    sync_debug: bool = False,
    share_pool_with: GraphBackend | None = None,
    check_input_liveness: bool = False,
    capture_error_mode: str = "thread_local",
    generators: Any = (),
) -> GraphBackend:
    """Build the backend called `name` ("auto" | "cuda" | "emulated") for `device`.

    "auto" is "cuda" when CUDA is available and `device` is a CUDA device, else
    "emulated". Every backend has its own memory pool; `share_pool_with=other` puts this
    one in `other`'s pool (same kind and device), to share memory between models that
    never step at the same time: then a replay of either invalidates the other's last
    output. `sync_debug` (cuda only) also runs the plain warmups under
    `torch.cuda.set_sync_debug_mode("error")` (the preflight always does).
    `check_input_liveness` (cuda only, debug, torch 2.13 and later): replays raise if a tensor
    the capture read was freed since; compiled forwards are then captured uncompiled.
    `capture_error_mode` (cuda only; `thread_local`, `global` or `relaxed`): what
    `CUDAGraph.capture_begin` is given (`capture.capture_error_mode`). `generators`: the
    engine's `torch.Generator`s of `device`, registered with every graph before its capture
    begins (`GraphBackend.add_generators`). Both are checked on every backend, before it is made.
    """
    if name not in BACKEND_NAMES:
        valid = ", ".join(BACKEND_NAMES)
        raise ValueError(f"unknown graph backend {name!r}; valid choices: {valid}")
    device = torch.device(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and device.type == "cuda" else "emulated"
    if capture_error_mode not in CAPTURE_ERROR_MODES:
        raise ValueError(
            f"capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)}; got {capture_error_mode!r}"
        )
    generators = check_generators(generators, device)
    pool = _shared_pool(share_pool_with, name, device)
    if name == "emulated":
        backend = EmulatedBackend(device, pool)
        backend.add_generators(generators)
        return backend
    from graphcap.backends.cuda import CUDAGraphBackend  # touches torch.cuda only when asked

    return CUDAGraphBackend(
        device,
        sync_debug=sync_debug,
        pool=pool,
        check_input_liveness=check_input_liveness,
        capture_error_mode=capture_error_mode,
        generators=generators,
    )


def backend_for(
    backend: str | GraphBackend, device: torch.device, config: CaptureConfig, generators: Any = ()
) -> tuple[GraphBackend, bool]:
    """A manager's backend and whether the manager owns it (a backend passed in is never reset by it).

    A name builds one with the config's `checks.sync_debug` and `capture.capture_error_mode`;
    `generators` (checked first: `TypeError`/`ValueError` naming `generators[i]`) are added to
    either kind (`GraphBackend.add_generators`).
    """
    if isinstance(backend, GraphBackend):
        backend.add_generators(generators)
        return backend, False
    generators = check_generators(generators, device)  # a tuple: an iterator is read once
    checks, capture = config.checks, config.capture
    made = get_backend(
        backend,
        device,
        generators=generators,
        sync_debug=checks.sync_debug,
        capture_error_mode=capture.capture_error_mode,
    )
    return made, True


def _shared_pool(other: GraphBackend | None, name: str, device: torch.device) -> GraphPool | None:
    if other is None:
        return None
    if not isinstance(other, GraphBackend):
        raise TypeError(f"share_pool_with must be a graph backend; got {type(other).__name__}")
    if other.name != name or other.device.type != device.type or (device.index not in (None, other.device.index)):
        raise ValueError(
            f"share_pool_with: a {name} backend on {device} cannot share the pool of a {other.name} backend "
            f"on {other.device}; pools are shared by backends of one kind on one device"
        )
    return other.pool


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
