"""Options and plumbing shared by the subcommands: config loading, `--set`, logging, the report path.

Building the parser needs only the standard library and `graphcap.devices`; the config package
loads when a command runs, so `graphcap --help` stays cheap.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from graphcap.devices import BACKEND_NAMES

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig


class UserError(Exception):
    """A mistake in what the user typed or pointed at; printed as one line, exit code 2."""


class CommandFailed(Exception):
    """The command ran and failed (not a usage mistake); printed as one line, exit code 1."""


def version() -> str:
    from graphcap.version import version

    return version()


def add_common(parser: argparse.ArgumentParser, *, config: bool = True, device: bool = True) -> None:
    """`--config`, `--set`, `--device`, `-v/-q`, `--debug` (the options most commands share)."""
    if config:
        parser.add_argument(
            "--config",
            metavar="PATH",
            help="YAML config file, or the name of a config shipped with graphcap, e.g. tiny-cpu-ci "
            "(default: the embedded default)",
        )
        add_overrides(parser)
    if device:
        parser.add_argument("--device", metavar="DEVICE", help="auto | cpu | cuda | cuda:N (overrides the config)")
        add_backend(parser)
    add_logging(parser)


def add_overrides(parser: argparse.ArgumentParser, help: str = "override one key") -> None:
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help=f"{help}, e.g. --set capture.max_size=16 (value read as YAML; repeatable)",
    )


def add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def setup_logging(args: argparse.Namespace) -> None:
    """Log lines on stderr: graphcap's at INFO (`-q`: WARNING, `-v`: DEBUG), other libraries' only
    from WARNING up (torch logs INFO lines of its own, some from exit handlers)."""
    import logging

    level = logging.WARNING if getattr(args, "quiet", False) else logging.INFO
    if getattr(args, "verbose", 0):
        level = logging.DEBUG
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("graphcap").setLevel(level)


def check_at_least(**bounds: tuple[int, int]) -> None:
    """`--flag` values against their minimum: `check_at_least(steps=(args.steps, 1))`; the first
    one below its minimum is a `UserError` naming the flag, the bound and the value."""
    for flag, (value, minimum) in bounds.items():
        if value < minimum:
            raise UserError(f"--{flag.replace('_', '-')} must be >= {minimum}; got {value}")


def stage(name: str) -> None:
    """Log the step the command starts now (a DEBUG line, `stage: NAME`, shown by `-v`): `-v`
    traces where a slow command is, and the interrupt tests signal the process at these lines."""
    import logging

    logging.getLogger("graphcap").debug("stage: %s", name)


def parse_overrides(items: list[str]) -> dict[str, object]:
    """`["capture.max_size=16"]` -> `{"capture.max_size": 16}`; values parse as YAML 1.2 scalars
    (quotes are stripped as YAML strips them: `model.name="tiny-llama"` is the string tiny-llama)."""
    from graphcap.config import YamlSyntaxError, parse_scalar

    out: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {_shown(item)}: expected KEY=VALUE, e.g. --set capture.max_size=16")
        try:
            out[key.strip()] = parse_scalar(text.strip())
        except YamlSyntaxError as exc:
            raise UserError(f"--set {_shown(item)}: {exc.message}") from None
    return out


def _shown(item: str) -> str:
    """`item` quoted for a message, cut short: a 5000-digit value should not fill the terminal."""
    return repr(item) if len(item) <= 60 else repr(item[:57] + "...")


def config_from_args(args: argparse.Namespace, **extra: object) -> CaptureConfig:
    """The config named by `--config` (a file, or the name of a bundled config; default: the
    embedded default) with `--set`, `--device` and `extra` applied."""
    from graphcap.config import load_config
    from graphcap.errors import ConfigFileNotFoundError

    overrides = parse_overrides(getattr(args, "overrides", []))
    overrides.update({k.replace("__", "."): v for k, v in extra.items() if v is not None})
    if getattr(args, "device", None):
        overrides["device"] = args.device
    try:
        return load_config(args.config, overrides)
    except ConfigFileNotFoundError as exc:
        raise UserError(f"--config {exc.problems[0].message}") from None


def add_backend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="auto", help="graph backend (default: auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="build even when the memory estimate exceeds what the device has (the estimate is shown anyway)",
    )


def add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report", metavar="PATH", help="write the full report here (.json/.yaml), atomically (overrides report.path)"
    )


def report_target(args: argparse.Namespace, config: CaptureConfig) -> str | None:
    """Where the report goes (`--report`, else `report.path`), checked before any work is done."""
    from graphcap.report_files import check_report_path

    path = config.report.path
    if path:
        check_report_path(path, not_same_as=(args.config,) if args.config else ())
    return path


def write_report(report, path: str) -> None:
    """Write the report; a failure is one line and exit 1 (the table is already printed)."""
    try:
        report.write(path)
    except OSError as exc:
        raise CommandFailed(f"cannot write the report to {path}: {exc.strerror or exc}") from exc
    print(f"report written to {path}")
