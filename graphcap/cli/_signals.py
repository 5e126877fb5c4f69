"""Ctrl-C while a command runs: the handler `graphcap.cli.main` installs, and whether it fired.

Standard library only (the command line imports it before anything else).
"""

from __future__ import annotations

__all__ = ["interrupted", "on_sigint", "reset"]

_interrupts = 0  # SIGINTs seen by the running command (see `interrupted`)


def interrupted() -> bool:
    """Whether Ctrl-C was pressed while the current command ran.

    Third-party code can swallow the `KeyboardInterrupt` (an import cut short may surface as
    an `AttributeError` much later), so the command's outcome is decided by this flag, set by
    the handler `main` installs first, not by which exception happens to arrive.
    """
    return _interrupts > 0


def on_sigint(signum: int, frame: object) -> None:
    global _interrupts
    _interrupts += 1
    raise KeyboardInterrupt


def reset() -> None:
    """A new command starts: no SIGINT seen yet."""
    global _interrupts
    _interrupts = 0
