"""`StepScope`: one manager step at a time, and never a step started from inside another.

Every `CaptureManager` step (`execute`, `eager`, `dispatch`, `capture`, `reset`, ...) runs inside
the scope: it holds the manager's re-entrant lock, so two threads never interleave staging and
replay; it sets the step's `graphcap.phase()` (`STEP_PHASES`); and it refuses a step that the
model's `prepare()` or `forward()` starts from inside the outer one (it would restage the
persistent buffers under it). A plain object, not a generator context: `execute` enters one on
every step, and the one it enters (`scope.execute`) is made once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import Token
from typing import Any

from graphcap.errors import CaptureError
from graphcap.phases import STEP_PHASES, Phase, enter_phase, leave_phase

__all__ = ["StepScope"]


class StepScope:
    """`with scope("eager"):` runs one step under `lock`, refusing a nested one."""

    __slots__ = ("execute", "lock", "on_failure", "running", "token")

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        """Held for the whole step (any context manager: a test's control experiment swaps in a no-op)."""
        self.running: str | None = None
        """The step running now (None between steps)."""
        self.token: Token[tuple[Phase, bool]] | None = None  # the phase to go back to when the step ends
        self.on_failure: Callable[[str, Any, BaseException], None] | None = None
        """Called as `on_failure(call, phase, exc)` when an exception leaves a step, before it propagates
        unchanged (the manager's post-mortem, `graphcap.postmortem`); None: nothing."""
        self.execute = _Step(self, "execute")
        """The scope of `execute`, made once (entered on every step)."""

    def __call__(self, what: str) -> _Step:
        return self.execute if what == "execute" else _Step(self, what)


class _Step:
    __slots__ = ("phase", "scope", "what")

    def __init__(self, scope: StepScope, what: str) -> None:
        self.scope, self.what = scope, what
        self.phase = STEP_PHASES.get(what, "outside")

    def __enter__(self) -> None:
        scope = self.scope
        lock = scope.lock
        lock.__enter__()
        outer = scope.running
        if outer is not None:
            lock.__exit__(None, None, None)
            raise CaptureError(
                f"manager.{self.what}() was called from inside {outer}() (from the model's prepare() or forward()); "
                "steps do not nest: it would restage the persistent buffers under the outer step. Call "
                f"{self.what}() outside the model, after the outer step returns"
            )
        scope.running = self.what
        scope.token = enter_phase(self.phase)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        scope = self.scope
        if exc is not None and scope.on_failure is not None:
            scope.on_failure(self.what, self.phase, exc)  # under the lock, before the phase is left
        scope.running = None
        token, scope.token = scope.token, None
        if token is not None:  # set by `__enter__`
            leave_phase(token)
        scope.lock.__exit__(None, None, None)
