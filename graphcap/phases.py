"""What graphcap is running right now: `phase()` and `is_capturing()`, for models and communicators.

A model (or an engine's communicator) that behaves differently while a graph records asks
here, not `torch.cuda.is_current_stream_capturing()`: that answers on CUDA, and on the emulated
backend only while one lives (`graphcap.backends.stream_answer`). vLLM's and SGLang's custom
all-reduce return a placeholder outside a graph's recording (warmups): with graphcap they
test `graphcap.is_capturing()`.

The phases (`phase()`):

- `"warmup"`: the eager warmups of a key before its capture (graphcap's dummy batch);
- `"capture"`: a capture pass (`capture()`, `capture_pending()`): staging a key's dummy batch, and
  its recording, the only time `is_capturing()` is true (graphcap's dummy batch);
- `"verify"`: verification after the capture context exits, its replays and their eager
  references (graphcap's dummy and probe batches);
- `"replay"`: `execute` (and `dispatch`) of a step that replays a graph: staging, the replay,
  piecewise eager ops (the engine's batch);
- `"eager"`: `execute` of a step that runs eagerly, and `eager()` (the engine's batch);
- `"outside"`: no graphcap step on this thread.

So an engine buffer's `check(host_view, num_real_rows)` and a model's `prepare` tell a dummy
step (`warmup`, `capture`, `verify`) from a real one (`replay`, `eager`) by `phase()`.
`is_capturing()` is true only while a graph records: never during warmups, verification,
replays, or an eager op run between graph pieces. Both are per thread (context variables).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar, Token
from typing import Literal

__all__ = [
    "DUMMY_PHASES",
    "STEP_PHASES",
    "Phase",
    "enter_phase",
    "failed_in",
    "in_phase",
    "is_capturing",
    "leave_phase",
    "mark_failure",
    "phase",
    "recording",
]

Phase = Literal["warmup", "capture", "verify", "replay", "eager", "outside"]

DUMMY_PHASES = frozenset({"warmup", "capture", "verify"})
"""Phases whose batches graphcap made (dummy and probe batches), not the engine."""

STEP_PHASES: dict[str, Phase] = {
    "capture": "capture",
    "capture_pending": "capture",
    "execute": "replay",
    "dispatch": "replay",
    "eager": "eager",
}
"""A `CaptureManager` call -> its phase (an `execute` that runs eagerly narrows to `eager`)."""

_STATE: ContextVar[tuple[Phase, bool]] = ContextVar("graphcap_phase_state", default=("outside", False))


def phase() -> Phase:
    """The phase of the graphcap step running on this thread (see the module doc); `"outside"` when none."""
    return _STATE.get()[0]


def is_capturing() -> bool:
    """True only while a graph records (a backend's capture of a key or a piece), on this thread."""
    return _STATE.get()[1]


@contextlib.contextmanager
def in_phase(name: Phase) -> Iterator[None]:
    """Run the enclosed code in phase `name`, with no graph recording."""
    token = _STATE.set((name, False))
    try:
        yield
    except BaseException as exc:
        mark_failure(exc, name)
        raise
    finally:
        _STATE.reset(token)


def enter_phase(name: Phase) -> Token[tuple[Phase, bool]]:
    """`in_phase` without a generator, for a step entered on every call: pass the token to `leave_phase`."""
    return _STATE.set((name, False))


def leave_phase(token: Token[tuple[Phase, bool]]) -> None:
    """Back to the phase before `enter_phase` gave `token`."""
    _STATE.reset(token)


@contextlib.contextmanager
def recording(active: bool = True) -> Iterator[None]:
    """Phase `capture`; `is_capturing()` is `active` inside (False: an eager op between pieces)."""
    token = _STATE.set(("capture", active))
    try:
        yield
    except BaseException as exc:
        mark_failure(exc, "recording" if active else "capture")
        raise
    finally:
        _STATE.reset(token)


_FAILED_IN = "_graphcap_failed_in"


def mark_failure(exc: BaseException, where: str) -> None:
    """Remember on `exc` the innermost phase it left (`failed_in`); an outer phase keeps the inner one's mark."""
    if getattr(exc, _FAILED_IN, None) is None:
        with contextlib.suppress(AttributeError, TypeError):  # an exception type with no instance dict: no mark
            setattr(exc, _FAILED_IN, where)


def failed_in(exc: BaseException) -> str | None:
    """The innermost graphcap phase `exc` left: `warmup`, `preflight` (the checked first warmup), `recording`
    (a graph recording), `capture`, `verify` or `eager`; None when it left none of them (a replay)."""
    return getattr(exc, _FAILED_IN, None)
