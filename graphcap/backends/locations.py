"""Where in the user's code an op was called: the innermost frame outside torch and graphcap/backends.

What `CaptureUnsafeError.location` and the piecewise checks name (`path:line`, relative to the
current folder when it lies below it).
"""

from __future__ import annotations

import os
import sys
from types import FrameType, TracebackType
from typing import Any

import torch

__all__ = ["traceback_location", "user_location"]

_SKIP_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    # the dispatch mode that watches a capture forward's collectives calls every op of the forward
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed", "ledger.py"),
)


def _shown(path: str, line: int) -> str:
    path = os.path.abspath(path)
    cwd = os.getcwd() + os.sep
    return f"{os.path.relpath(path) if path.startswith(cwd) else path}:{line}"


def _is_user(code: Any) -> bool:
    return not os.path.abspath(code.co_filename).startswith(_SKIP_DIRS)


def user_location() -> str:
    """file:line of the innermost frame outside torch/ and graphcap/backends/."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not _is_user(frame.f_code):
        frame = frame.f_back
    return "<unknown location>" if frame is None else _shown(frame.f_code.co_filename, frame.f_lineno)


def traceback_location(tb: TracebackType | None) -> str:
    """file:line of the innermost user frame of a traceback (where the failing call was made)."""
    found = "<unknown location>"
    while tb is not None:
        if _is_user(tb.tb_frame.f_code):
            found = _shown(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found
