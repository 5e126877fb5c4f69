"""`PostMortem`: what a manager's step scope calls when an exception leaves one of its calls."""

from __future__ import annotations

from typing import Any

from graphcap.postmortem.file import EXCEPTED, environment_rank, write_postmortem
from graphcap.postmortem.recorder import FlightRecorder

__all__ = ["CALLS", "PostMortem", "flight_recorder"]

CALLS = frozenset({"execute", "capture", "capture_pending"})
"""The manager calls whose failure writes a post-mortem."""


def flight_recorder(config: Any, buffers: Any) -> FlightRecorder | None:
    """The recorder `report.flight_steps` asks for over `buffers`' packed layout; None when it is 0."""
    steps = config.report.flight_steps
    return FlightRecorder(buffers.layout, steps) if steps else None


class PostMortem:
    """Writes the recorder's steps when an error (not one of `EXCEPTED`) leaves a call of `CALLS`, and names
    the file on the error, which the scope then re-raises unchanged (`graphcap.postmortem.file`)."""

    __slots__ = ("manager", "recorder")

    def __init__(self, manager: Any, recorder: FlightRecorder) -> None:
        self.manager, self.recorder = manager, recorder

    def __call__(self, call: str, call_phase: str, exc: BaseException) -> None:
        if call not in CALLS or not isinstance(exc, Exception) or isinstance(exc, EXCEPTED):
            return
        manager = self.manager
        try:
            rank, world = environment_rank(manager._peers)
        except Exception:  # a peer object half torn down: the file names no rank
            rank, world = None, None
        write_postmortem(  # never raises: a failure to write is a note on `exc`
            exc,
            call,
            call_phase,
            self.recorder.steps(),
            setting=manager.config.report.postmortem,
            fields=manager.buffers.layout.entries,
            limits=manager.buffers.limits,
            invariants=manager.config.checks.invariants,
            rank=rank,
            world_size=world,
            num_recorded=self.recorder.num_recorded,
        )
