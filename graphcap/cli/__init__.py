"""The `graphcap` command: one subcommand per module, results on stdout, progress on stderr.

Exit codes: 0 ok, 1 the command ran and failed (capture, verification, a report that could not
be written, stdout that could not be written), 2 usage or config error, 130 interrupted (`main`
returns it; the console script and `python -m graphcap` then end by SIGINT itself, so a shell
reports 130 and a calling script stops too). Every error is one line (or one line per config
problem) without a traceback; `--debug` shows it.

Start-up is cheap on purpose: this module imports only the standard library, and `main`
imports everything else inside its own handler, so a Ctrl-C at any moment prints
"interrupted" (exit 130), and `--help`, `--version` and `validate` never import torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from graphcap.cli import _signals
from graphcap.cli._signals import interrupted

__all__ = ["INTERRUPTED", "console_main", "interrupted", "main"]

INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    _signals.reset()
    previous = None
    with contextlib.suppress(ValueError):  # signals can only be set from the main thread
        previous = signal.signal(signal.SIGINT, _signals.on_sigint)
    args = None
    try:
        from graphcap.cli._main import build_parser, run_command

        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        code = run_command(args)
        if interrupted():  # swallowed somewhere, and the command went on: it was still interrupted
            raise KeyboardInterrupt
        return code
    except Exception:
        if not interrupted():
            raise  # a bug in graphcap: keep its traceback
        return _say_interrupted(args)
    except KeyboardInterrupt:
        return _say_interrupted(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _say_interrupted(args: object) -> int:
    command = getattr(args, "command", None)
    print(f"graphcap{' ' + command if command else ''}: interrupted", file=sys.stderr)
    return INTERRUPTED


def console_main() -> NoReturn:
    """The `graphcap` console script and `python -m graphcap`: run `main`, exit with its code."""
    code = main()
    if code == INTERRUPTED and hasattr(signal, "SIGINT"):
        # End the way an interrupted program should: by the signal, with the default action.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to add
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)
