"""`version()`: graphcap's version, from the installed package's metadata (pyproject.toml writes it once)."""

from __future__ import annotations

import functools

__all__ = ["version"]


@functools.cache
def version() -> str:
    """The installed version of graphcap; `0+unknown` for a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as metadata_version

    try:
        return metadata_version("graphcap")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH that was never installed
        return "0+unknown"
