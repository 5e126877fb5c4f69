"""`graphcap capture`: capture every planned graph of a config and print what happened."""

from __future__ import annotations

import argparse
import sys

from graphcap.cli._common import (
    CommandFailed,
    add_common,
    add_report,
    config_from_args,
    report_target,
    stage,
    write_report,
)

EPILOG = """examples:
  graphcap capture                                  # embedded default: tiny model, best device
  graphcap capture --config llama3-8b-h200 --report capture.json
  graphcap capture --set capture.max_size=16 --device cpu --no-progress

The first log line gives the memory estimate; a config that cannot fit the device is refused
before anything is built (exit 2; --skip-memory-check to try anyway). The table goes to stdout,
progress and logs to stderr. Exit 0 when graphs were captured (keys skipped under
capture.on_error: skip are listed), 1 when capture failed, nothing was captured, or the report
could not be written (the table is printed first), 2 for a config or usage error.
With capture.strategy: lazy nothing is captured here: the summary lists the pending keys, which an
engine captures in idle time with manager.capture_pending().
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "capture",
        help="capture the CUDA graphs of a config and report time and memory per graph",
        description="Build the model of a config, capture a graph for every planned key (largest first), "
        "verify each replay against eager, and print a table and a summary.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(parser)
    add_report(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from graphcap.cli._setup import build_manager

    config = config_from_args(args, report__path=args.report)
    report_path = report_target(args, config)
    # The manager does not write the report: this command writes it after printing the table,
    # so a failed write costs one line, not the capture's result.
    manager = build_manager(args, dataclasses.replace(config, report=dataclasses.replace(config.report, path=None)))
    stage("capturing")
    report = manager.capture()
    report.config = config.to_dict()
    report.command = command_line(args)
    print(report.table())
    print()
    print(report.summary())
    sys.stdout.flush()
    if report_path:
        write_report(report, report_path)
    check_something_captured(report)
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The command as typed (for the report), quoted so it can be pasted back into a shell."""
    import shlex

    return shlex.join(["graphcap", *args.argv])


def check_something_captured(report) -> None:
    """Exit 1 when keys were planned and every one was skipped: nothing would replay."""
    if report.records and not report.captured:
        raise CommandFailed(
            f"nothing was captured: all {len(report.records)} keys were skipped (capture.on_error: skip, "
            "capture.memory_budget or capture.min_speedup); "
            "every step would run eagerly. The reasons are in the table above"
        )
