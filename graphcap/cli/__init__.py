"""The `graphcap` command: one subcommand per module, results on stdout, progress on stderr.

Exit codes: 0 ok, 1 verification failed, 2 usage or config error. A user error prints one
line per problem and no traceback (`--debug` shows it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from graphcap.backends import CaptureError
from graphcap.cli import _common
from graphcap.config import ConfigError
from graphcap.invariants import InvariantViolation

__all__ = ["main"]

# Subcommand modules, in the order `--help` lists them.
_COMMANDS = ("capture", "verify", "sizes", "bench", "validate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphcap",
        description="Capture and replay CUDA graphs for LLM inference, with the padded tail proven right.",
        epilog="Run `graphcap COMMAND --help` for a command's options and an example.",
    )
    parser.add_argument("--version", action="version", version=f"graphcap {_common.version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        module = _common.command_module(name)
        if module is not None:
            module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _common.setup_logging(args)
    try:
        return int(args.run(args) or 0)
    except (_common.UserError, ConfigError) as exc:
        if args.debug:
            raise
        print(f"graphcap {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (CaptureError, InvariantViolation) as exc:
        if args.debug:
            raise
        print(f"graphcap {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"graphcap {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        logging.shutdown()
