"""Fixtures for the backend tests: a fresh emulated backend, reset after each test."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from graphcap.backends import EmulatedBackend


@pytest.fixture
def emulated() -> Iterator[EmulatedBackend]:
    backend = EmulatedBackend("cpu")
    yield backend
    backend.reset()


def marked_line(fn: Callable, marker: str = "# unsafe") -> str:
    """'tests/backends/<file>.py:<line>' of the line in `fn`'s source that carries `marker`."""
    lines, start = inspect.getsourcelines(fn)
    offsets = [i for i, line in enumerate(lines) if marker in line]
    if len(offsets) != 1:
        raise ValueError(f"{fn.__name__} must mark exactly one line with {marker!r}")
    path = Path(inspect.getsourcefile(fn))
    return f"{Path(*path.parts[-3:])}:{start + offsets[0]}"
