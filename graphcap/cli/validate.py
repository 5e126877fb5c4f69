"""`graphcap validate CONFIG...`: every problem in every file, exit 2 if any."""

from __future__ import annotations

import argparse
import sys

from graphcap.cli._common import add_logging, add_overrides, parse_overrides

EPILOG = """example:
  graphcap validate my.yaml other.yaml
  graphcap validate my.yaml --set capture.max_size=128
  graphcap validate tiny-cpu-ci                    # a config shipped with graphcap, by name
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "validate",
        help="check config files and list every problem",
        description="Load each YAML config strictly and print every problem (dotted key, value, fix, file:line).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "configs", nargs="+", metavar="CONFIG", help="YAML files (or names of configs shipped with graphcap) to check"
    )
    add_overrides(parser, "override applied to every file")
    add_logging(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from graphcap.config import ConfigError, load_config
    from graphcap.errors import ConfigFileNotFoundError

    overrides = parse_overrides(args.overrides)
    failed = 0
    for path in args.configs:
        try:
            load_config(path, overrides)
        except ConfigFileNotFoundError as exc:
            failed += 1
            print(f"{path}: {exc.problems[0].message}")
        except ConfigError as exc:
            failed += 1
            print(f"{path}: {len(exc.problems)} problem{'s' if len(exc.problems) != 1 else ''}")
            for problem in exc.problems:
                print(f"  {problem}")
        else:
            print(f"{path}: ok")
    if failed:
        print(f"{failed} of {len(args.configs)} config{'s' if len(args.configs) != 1 else ''} invalid", file=sys.stderr)
        return 2
    return 0
