"""`graphcap capture`: capture every planned graph of a config and print what happened."""

from __future__ import annotations

import argparse
import sys

from graphcap.cli._common import add_common, build_manager

EPILOG = """examples:
  graphcap capture                                  # embedded default: tiny model, best device
  graphcap capture --config capture_configs/llama3-8b-h200.yaml --report capture.json
  graphcap capture --set capture.max_size=16 --device cpu --no-progress

The table goes to stdout, progress and logs to stderr. Exit 0 when every graph was
captured (or skipped under capture.on_error: skip), 1 when capture failed, 2 for a
config or usage error.
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
    parser.add_argument("--report", metavar="PATH", help="write the full report here (.json/.yaml), atomically")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    manager = build_manager(args, report_path=args.report)
    report = manager.capture()
    print(report.table())
    print()
    print(report.summary())
    if manager.config.report.path:
        print(f"report written to {manager.config.report.path}")
    sys.stdout.flush()
    return 0
