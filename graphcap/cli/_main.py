"""The parser of every subcommand, and the one place where an error becomes an exit code.

Each subcommand module imports only the standard library and `graphcap.config` at module
level; torch and the rest load inside its `run`, so building this parser stays cheap.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Any, TextIO

from graphcap.cli import _common, bench, capture, inspect, sizes, validate, verify

__all__ = ["COMMANDS", "OutputError", "build_parser", "run_command"]

COMMANDS = (capture, verify, sizes, bench, validate, inspect)
"""The subcommand modules, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphcap",
        description="Capture and replay CUDA graphs for LLM inference, with the padded tail proven right.",
        epilog="Run `graphcap COMMAND --help` for a command's options and an example.",
    )
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


class _Version(argparse.Action):
    """`--version`: the installed version, read from the package metadata only when asked."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"graphcap {_common.version()}")
        parser.exit()


class OutputError(Exception):
    """stdout could not be written (disk full, closed pipe): the command's result is lost."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(f"cannot write the output to stdout: {cause.strerror or cause}")
        self.errno = cause.errno


class _GuardedStream:
    """`sys.stdout` while a command runs: an `OSError` of a write or flush becomes `OutputError`,
    so a full disk is told apart from a failure of the command itself. A closed stdout
    (`graphcap sizes >&-`: Python sets `sys.stdout` to None) fails the first write the same way,
    instead of `print` dropping the result without a word."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._open().write(text)
        except OSError as exc:
            raise OutputError(exc) from exc

    def flush(self) -> None:
        if self._stream is None:
            return  # nothing was written: nothing is lost
        try:
            self._stream.flush()
        except OSError as exc:
            raise OutputError(exc) from exc

    def _open(self) -> TextIO:
        if self._stream is None:
            raise OSError(errno.EBADF, "stdout is closed")
        return self._stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_DEPENDENCIES = {
    "torch": "install the torch build for this machine first (README, Quick start), then graphcap",
    "numpy": "pip install numpy (graphcap's dependencies: pip install graphcap)",
    "yaml": "pip install pyyaml (graphcap's dependencies: pip install graphcap)",
    "tqdm": "pip install tqdm (graphcap's dependencies: pip install graphcap)",
}
"""Packages a command imports when it runs, and how to install each."""


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; map its errors to one line on stderr and an exit code."""
    from graphcap.errors import BatchError, CaptureError, ConfigError, InvariantViolation

    # Exceptions that are the user's input (exit 2) or a failure of the command (exit 1); anything
    # else is a bug in graphcap and keeps its traceback.
    user_errors = (_common.UserError, ConfigError)
    failures = (_common.CommandFailed, CaptureError, InvariantViolation, BatchError)
    _common.setup_logging(args)
    _common.stage(f"{args.command} started")
    stdout = sys.stdout
    sys.stdout = guarded = _GuardedStream(stdout)
    try:
        code = int(args.run(args) or 0)
        guarded.flush()  # a full disk shows here, while the error can still be reported
        return code
    except user_errors as exc:
        return _report(args, "error", exc, 2)
    except failures as exc:
        return _report(args, "failed", exc, 1)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _DEPENDENCIES:
            raise  # not a dependency: a bug in graphcap (or a factory's import, named by the config error)
        return _report(args, "error", f"{missing} is not installed: {_DEPENDENCIES[missing]}", 2)
    except MemoryError as exc:
        return _report(args, "failed", f"out of host memory ({type(exc).__name__}: {exc or 'no detail'})", 1)
    except OutputError as exc:
        _silence(stdout)
        if exc.errno == errno.EPIPE:  # the reader went away (`graphcap sizes | head`): not an error
            return 0
        return _report(args, "failed", exc, 1)
    finally:
        import logging  # loaded by setup_logging above

        sys.stdout = stdout
        logging.getLogger("graphcap").setLevel(logging.NOTSET)  # a library user's settings apply again
        logging.shutdown()


def _report(args: argparse.Namespace, word: str, error: BaseException | str, code: int) -> int:
    from graphcap.cli._signals import interrupted

    if interrupted():  # the error is what Ctrl-C left behind (e.g. an import cut short): say so
        raise KeyboardInterrupt
    if args.debug and isinstance(error, BaseException):
        raise error
    print(f"graphcap {args.command}: {word}: {error}", file=sys.stderr)
    return code


def _silence(stream: TextIO) -> None:
    """Point a broken stdout at /dev/null, so the interpreter's last flush at exit stays quiet."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture buffer)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
