"""From the common options to a `CaptureManager`: config, device and backend, memory, model.

In this order, so each mistake is caught before the expensive step it would ruin: the
config is validated, the device and backend must agree, the memory estimate must fit the
device (host RAM on the CPU, free memory on a GPU), and only then is the model built. A
failure while building is one line naming what sizes it (`--debug` for the traceback).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from graphcap.cli._common import CommandFailed, UserError, config_from_args, stage
from graphcap.errors import ConfigError

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig

__all__ = ["build_manager"]

_EMULATED_NOTE = " (no CUDA here: the emulated backend reproduces CUDA-graph semantics on the CPU)"


def build_manager(args: argparse.Namespace, config: CaptureConfig | None = None) -> Any:
    """Config (unless given), device, backend, memory check, model and manager from the common options.

    The first log line names the model, the device, the backend and the memory estimate.
    """
    import logging

    config = config_from_args(args) if config is None else config
    stage("importing torch")
    from graphcap.backends import resolve_device
    from graphcap.config.byte_counts import format_bytes
    from graphcap.manager import CaptureManager
    from graphcap.memory.estimate import KEYS, estimate_memory

    device = resolve_device(config)  # ConfigError (exit 2) for a GPU that is not there
    backend = _backend_name(args.backend, device)
    factory = None
    piecewise = config.capture.mode in ("piecewise", "full_and_piecewise")
    if config.model.factory is None and piecewise and config.model.attention != "per_request":
        raise UserError(
            f"capture.mode {config.capture.mode} cuts the forward at its eager_op calls, and the built-in model "
            f"with model.attention {config.model.attention} has none (its attention reads request metadata, "
            "which graph pieces cannot hold): set model.attention=per_request, or capture.mode=full"
        )
    if config.model.factory is not None:
        from graphcap.models import load_factory

        factory = load_factory(config.model.factory, beside=config.source)
    try:
        estimate = estimate_memory(config, backend=backend, model_estimate=getattr(factory, "estimate_memory", None))
    except Exception as exc:  # a factory's own estimate_memory failed: its bug, named as such
        raise CommandFailed(f"estimate_memory of model.factory {config.model.factory} raised {_cause(exc)}") from exc
    model_name = config.model.name or config.model.factory
    note = _EMULATED_NOTE if backend == "emulated" and device.type == "cpu" else ""
    log = logging.getLogger("graphcap")
    log.info("model %s on %s, %s backend%s; %s", model_name, device, backend, note, estimate.describe())
    if not args.skip_memory_check:
        from graphcap.memory.estimate import available_memory

        available, what = available_memory(device)
        if available is not None and estimate.total > available:
            part, size = estimate.largest_part()
            named = estimate.name_of(part)
            if part == "graphs" and estimate.capture_transient:
                named += " with the capture transient"
            raise UserError(
                f"the memory estimate {format_bytes(estimate.total)} does not fit in the {format_bytes(available)} "
                f"{what}; the largest part is {named} {format_bytes(size)}, sized by "
                f"{KEYS.get(part, part)}: lower them, or pass --skip-memory-check if you know better "
                "(every part is in the log line above)"
            )
    stage("building the model")
    model = _build_model(config, device, estimate)
    try:
        return CaptureManager(model, config, backend=args.backend, progress=False if args.no_progress else None)
    except Exception as exc:  # allocating the persistent buffers: name what sizes them
        raise CommandFailed(
            f"allocating the persistent buffers failed: {_cause(exc)}; they are sized by {KEYS['buffers']} "
            f"(estimate {format_bytes(estimate.parts['buffers'])})"
        ) from exc


def _backend_name(requested: str, device: Any) -> str:
    """The backend `requested` resolves to on `device`; a CUDA request without CUDA is a usage error."""
    import torch

    if requested == "cuda":
        if not torch.cuda.is_available():
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UserError(
                f"--backend cuda: CUDA is not available (torch {torch.__version__}, {built}); "
                "use --backend emulated (or auto)"
            )
        if device.type != "cuda":
            raise UserError(f"--backend cuda needs a CUDA device; the device is {device}: use --device cuda")
        return "cuda"
    if requested == "emulated":
        return "emulated"
    return "cuda" if device.type == "cuda" and torch.cuda.is_available() else "emulated"


def _build_model(config: CaptureConfig, device: Any, estimate: Any) -> Any:
    from graphcap.config.byte_counts import format_bytes
    from graphcap.memory.estimate import KEYS
    from graphcap.models import build_model

    try:
        return build_model(config, device)
    except ConfigError:
        raise
    except Exception as exc:  # anything a factory or an allocation can raise, named in one line
        if config.model.factory is not None:
            raise CommandFailed(f"model.factory {config.model.factory} raised {_cause(exc)}") from exc
        sized = "; ".join(
            f"{name.replace('_', ' ')} {format_bytes(estimate.parts[name])} by {KEYS[name]}"
            for name in ("weights", "kv_cache")
        )
        raise CommandFailed(
            f"building model {config.model.name} failed: {_cause(exc)}; it is sized so: {sized}"
        ) from exc


def _cause(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
