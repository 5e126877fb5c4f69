"""Hostile and careless uses of the `graphcap` command, as data: files, argv, exit code, message.

Shared by `tests/cli/test_hostile.py` (every case once) and `tools/reliability.py` (the same
cases, one row per area of docs/RELIABILITY.md), so the suite and the campaign cannot drift
apart. A case runs `graphcap.cli.main` in-process with stdout and stderr captured. It passes
when the exit code is the expected one, stderr matches `match`, nothing prints a traceback,
every error is one line (a config error: one line per problem), and its `check` holds.

In `argv`, `{tmp}` is the case's own directory and `{tiny}` a one-layer config written there.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from graphcap.config import MAX_CONFIG_BYTES

from . import cli_setups as setups

__all__ = ["CLI_CASES", "CLOSED", "CliCase", "CliResult", "check_case", "run_case"]

CLOSED = "<closed>"
"""`CliCase.stdout` for a closed stdout (Python sets `sys.stdout` to None)."""


@dataclass(frozen=True)
class CliCase:
    """One use of the command and what it must do."""

    area: str
    name: str
    argv: tuple[str, ...]
    code: int
    match: str
    """A regular expression searched in stderr."""
    setup: Callable[[Path], None] | None = None
    check: Callable[[Path, str, str], None] | None = None
    """`(tmp, stdout, stderr)`; raises AssertionError when the outcome is wrong."""
    patch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    """A fault injected around the run (a disk that fills up)."""
    skip: Callable[[], str | None] | None = None
    """A reason this machine cannot run the case, or None."""
    stdout: str | None = None
    """A file to give the command as its stdout (`/dev/full`), or `CLOSED` (`graphcap ... >&-`)."""


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


def run_case(case: CliCase, tmp: Path) -> CliResult:
    """Write the case's files under `tmp` and run the command in-process."""
    from graphcap.cli import main

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(setups.TINY, sort_keys=False))
    if case.setup is not None:
        case.setup(tmp)
    argv = [arg.format(tmp=tmp, tiny=tmp / "tiny.yaml") for arg in case.argv]
    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        out: Any = io.StringIO()
        if case.stdout is not None:
            out = None if case.stdout == CLOSED else stack.enter_context(open(case.stdout, "w"))
        stack.enter_context(contextlib.redirect_stdout(out))  # a closed stdout: Python sets None
        stack.enter_context(contextlib.redirect_stderr(err))
        if case.patch is not None:
            stack.enter_context(case.patch())
        code = main(argv)
        text = out.getvalue() if isinstance(out, io.StringIO) else ""
    return CliResult(code, text, err.getvalue())


def check_case(case: CliCase, tmp: Path) -> CliResult:
    """Run the case and raise `AssertionError` naming what went wrong."""
    result = run_case(case, tmp)
    shown = f"exit {result.code}; stderr: {result.err.strip()[-600:]!r}"
    if result.code != case.code:
        raise AssertionError(f"expected exit {case.code}, got {shown}")
    if not re.search(case.match, result.err):
        raise AssertionError(f"stderr does not match {case.match!r}: {shown}")
    if "Traceback" in result.err + result.out:
        raise AssertionError(f"a traceback: {shown}")
    # Log lines and the indented lines of a config error aside, a failure says one thing.
    said = [line for line in result.err.splitlines() if line and not line.startswith((" ", *_LOG_LEVELS))]
    if case.code and len(said) != 1:
        raise AssertionError(f"expected one error line, got {len(said)}: {shown}")
    if case.check is not None:
        case.check(tmp, result.out, result.err)
    return result


_LOG_LEVELS = ("DEBUG ", "INFO ", "WARNING ", "ERROR ")


_CAP = ("capture", "--config", "{tiny}", "--no-progress")
_FACTORY = setups.__name__  # the name this module was imported by: the in-process command imports it again

CLI_CASES: tuple[CliCase, ...] = (
    # -- files and flags: one line, exit 2 (exit 1 for a failure of the run itself)
    CliCase("files", "config: symlink loop", ("sizes", "--config", "{tmp}/a.yaml"), 2, r"\(ELOOP\)", setups.symlink_loop),
    CliCase("files", "config: not a directory", ("sizes", "--config", "{tiny}/x.yaml"), 2, r"\(ENOTDIR\)"),
    CliCase("files", "config: name too long", ("sizes", "--config", "{tmp}/" + "x" * 300), 2, r"\(ENAMETOOLONG\)"),
    CliCase("files", "config: a directory", (*_CAP[:2], "{tmp}"), 2, r"cannot read .*: Is a directory \(EISDIR\)"),
    CliCase("files", "config: I/O error", ("sizes", "--config", "/proc/self/mem"), 2, r"\(EIO\)", skip=setups.missing("/proc/self/mem")),
    CliCase("files", "config: permission denied", ("sizes", "--config", "{tmp}/secret.yaml"), 2, r"Permission denied \(EACCES\)", setups.chmod_zero, skip=setups.root),
    CliCase("files", "config: /dev/zero", ("sizes", "--config", "/dev/zero"), 2, r"is larger than 1 MiB", skip=setups.missing("/dev/zero")),
    CliCase("files", "config: a 3 MB list", ("sizes", "--config", "{tmp}/list.yaml"), 2, r"larger than 1 MiB", setups.write("list.yaml", "x:\n" + "- 1\n" * (3 << 18))),
    CliCase("files", "config: 20 MB of comments", ("sizes", "--config", "{tmp}/c.yaml"), 2, r"larger than 1 MiB", setups.write("c.yaml", "#" * (20 << 20))),
    CliCase("files", "config: 350k nodes under 1 MiB", ("sizes", "--config", "{tmp}/n.yaml"), 2, r"more than 16384 values", setups.write("n.yaml", "x: [" + "1, " * ((MAX_CONFIG_BYTES - 16) // 3) + "1]")),
    CliCase("files", "config: not UTF-8", ("sizes", "--config", "{tmp}/l1.yaml"), 2, r"not UTF-8 text: byte 0xe9", setups.write("l1.yaml", b"model: {name: caf\xe9}\n")),
    CliCase("files", "config: missing file", ("capture", "--config", "{tmp}/nope.yaml"), 2, r"^graphcap capture: error: --config config file not found: .*nope\.yaml \(configs shipped with graphcap, loadable by name: .*tiny-cpu-ci\)\n$"),
    CliCase("files", "config: bundled, by name", ("sizes", "--config", "tiny-cpu-ci"), 0, r"^$", check=setups.out_has("capture sizes from tiny-cpu-ci")),
    CliCase("files", "factory beside the config, run from elsewhere", ("capture", "--config", "{tmp}/proj/factory.yaml", "--no-progress"), 1, r"model\.factory beside_config_factory:make raised ValueError: found beside the config", setups.factory_beside_config),
    CliCase("files", "config: 5000-digit integer", ("sizes", "--config", "{tmp}/i.yaml"), 2, r"model\.seed: integer too long \(5000 digits", setups.write("i.yaml", "model: {seed: " + "7" * 5000 + "}\n")),
    CliCase("flags", "--set: 5000-digit integer", ("sizes", "--set", "model.seed=" + "7" * 5000), 2, r"--set 'model\.seed=7{40,}\.\.\.': integer too long"),
    CliCase("flags", "--set: quoted value loses its quotes", ("validate", "{tiny}", "--set", 'model.name="tiny-llama"'), 0, r"^$", check=setups.out_has(": ok")),
    CliCase("flags", "--set: quoted number stays a string", ("validate", "{tiny}", "--set", "capture.max_size='4'"), 2, r"^1 of 1", check=setups.out_has("a quoted number is a string")),
    CliCase("flags", "seed >= 2**64", ("validate", "{tiny}", "--set", f"model.seed={2**64}"), 2, "", check=setups.out_has("model.seed: must be <= 18446744073709551615")),
    CliCase("flags", "hidden_size 1M", ("validate", "{tiny}", "--set", "model.hidden_size=1048576"), 2, "", check=setups.out_has("model.hidden_size: must be <= 65536")),
    CliCase("flags", "max_num_tokens 2**31-1", ("validate", "{tiny}", "--set", "batching.max_num_tokens=2147483647"), 2, "", check=setups.out_has("must be <= 16777216")),
    CliCase("flags", "model build fails: key and cause named", (*_CAP, "--skip-memory-check", "--set", "model.hidden_size=65536", "--set", "model.num_heads=512", "--set", "model.vocab_size=16777216"), 1, r"building model tiny-llama failed: (RuntimeError|OutOfMemoryError): .*weights .* by model\.hidden_size", skip=setups.overcommit_always),
    CliCase("flags", "factory raises: one line", (*_CAP, "--set", f"model.factory={_FACTORY}:raising_factory"), 1, rf"failed: model\.factory {_FACTORY}:raising_factory raised ValueError: checkpoint /models"),
    CliCase("flags", "sizes --max-size 10**8", ("sizes", "--max-size", "100000000"), 2, r"--max-size: must be <= 65536; got 100000000"),
    CliCase("flags", "sizes --max-size 10**9", ("sizes", "--max-size", "1000000000"), 2, r"--max-size: must be <= 65536"),
    CliCase("flags", "histogram: not UTF-8", ("sizes", "--histogram", "{tmp}/h.txt"), 2, r"h\.txt:2: not UTF-8 text \(byte 0xff\)", setups.write("h.txt", b"4\n\xff\xfe\n")),
    CliCase("flags", "histogram: /dev/zero", ("sizes", "--histogram", "/dev/zero"), 2, r"/dev/zero:1: line longer than 4096 bytes", skip=setups.missing("/dev/zero")),
    CliCase("flags", "histogram: weights sum to infinity", ("sizes", "--histogram", "{tmp}/h.txt"), 2, r"the counts sum to inf; scale them down", setups.write("h.txt", "4 1e308\n8 1e308\n")),
    CliCase("flags", "histogram: every step above the max size", ("sizes", "--histogram", "{tmp}/h.txt", "--max-graphs", "3"), 2, r"^graphcap sizes: error: --histogram .*h\.txt: no observed step can replay: the smallest token count 100 is above capture\.max_size 64, so no size can be chosen; .*\n$", setups.write("h.txt", "100 5\n120 3\n")),
    CliCase("flags", "histogram: a 1e300 step count", ("sizes", "--histogram", "{tmp}/h.txt", "--max-graphs", "3"), 0, r"^$", setups.write("h.txt", "1 1e300\n2 5\n"), check=setups.out_has("chosen for 1e+300 steps")),
    CliCase("flags", "sizes --out under a file", ("sizes", "--histogram", "{tmp}/h.txt", "--max-graphs", "3", "--out", "{tmp}/h.txt/s.yaml"), 2, r"^graphcap sizes: error: --out .*s\.yaml: cannot be created: .*h\.txt is not a directory\n$", setups.write("h.txt", "4 5\n")),
    CliCase("flags", "sizes > /dev/full", ("sizes",), 1, r"^graphcap sizes: failed: cannot write the output to stdout: No space left on device\n$", stdout="/dev/full", skip=setups.missing("/dev/full")),
    CliCase("flags", "stdout closed (>&-)", ("sizes",), 1, r"^graphcap sizes: failed: cannot write the output to stdout: stdout is closed\n$", stdout=CLOSED),
    CliCase("flags", "verify --seed -1", ("verify", "--config", "{tiny}", "--seed", "-1"), 2, r"^graphcap verify: error: --seed must be >= 0; got -1\n$"),
    CliCase("flags", "--device cuda:<huge>", (*_CAP, "--device", "cuda:99999999999999999999"), 2, r"device: cuda:999999999\.\.\. is not a device index torch can hold \(0\.\.127\)"),
    CliCase("flags", "--device cuda:128 (torch would wrap it to -128)", (*_CAP, "--device", "cuda:128"), 2, r"device: cuda:128 is not a device index"),
    CliCase("flags", "--backend cuda without CUDA", (*_CAP, "--backend", "cuda"), 2, r"--backend cuda: CUDA is not available", skip=setups.with_cuda),
    CliCase("flags", "--device cuda without CUDA", (*_CAP, "--device", "cuda"), 2, r"'cuda' requested but CUDA is not available", skip=setups.with_cuda),
    CliCase("flags", "on_error skip, every key skipped", (*_CAP, "--set", "capture.on_error=skip", "--set", f"model.factory={_FACTORY}:unsafe_factory"), 1, r"nothing was captured: all 4 keys were skipped", check=setups.table_printed),
    # -- reports and plots
    CliCase("reports", "--report is the --config file", (*_CAP, "--report", "{tiny}"), 2, r"is the config file itself", check=setups.unchanged("tiny.yaml")),
    CliCase("reports", "report.path is its own config file", ("capture", "--config", "{tmp}/self.yaml"), 2, r"is the config file itself", setups.self_report, check=setups.unchanged("self.yaml")),
    CliCase("reports", "report replaces a 0640 report: mode kept", (*_CAP, "--report", "{tmp}/report.json"), 0, "", lambda tmp: (setups.write("report.json", '{"graphcap_report": 1}')(tmp), (tmp / "report.json").chmod(0o640)), check=setups.report_mode(0o640)),
    CliCase("reports", "report.path over a file graphcap did not write", ("capture", "--config", "{tmp}/overwrite.yaml"), 2, r"ci\.yml exists and is not a graphcap report", setups.ci_workflow, check=setups.ci_unchanged),
    CliCase("reports", "--report over a file graphcap did not write", (*_CAP, "--report", "{tmp}/.github/workflows/ci.yml"), 2, r"ci\.yml exists and is not a graphcap report", setups.ci_workflow, check=setups.ci_unchanged),
    CliCase("reports", "report.path escapes the config's directory and the working directory", ("capture", "--config", "{tmp}/proj/escape.yaml"), 2, r"report\.path: .*graphcap-escape\.json resolves to /proc/graphcap-escape\.json, outside .*: give this path on the command line", setups.outside_report),
    CliCase("reports", "report path too long", (*_CAP, "--report", "{tmp}/" + "r" * 300 + ".json"), 2, r"report\.path: .* cannot be used: File name too long \(ENAMETOOLONG\)"),
    CliCase("reports", "new report: 0666 under the umask", (*_CAP, "--report", "{tmp}/report.json"), 0, "", check=setups.report_mode(None)),
    CliCase("reports", "report write fails: table, then one line", (*_CAP, "--report", "{tmp}/report.json"), 1, r"cannot write the report to .*report\.json: No space left on device", check=setups.table_printed, patch=setups.disk_full),
    CliCase("reports", "report says where and how it was made", (*_CAP, "--report", "{tmp}/report.json"), 0, "", check=setups.report_contents),
    CliCase("reports", "--plot into a directory", ("bench", "--config", "{tiny}", "--plot", "{tmp}"), 2, r"--plot .*: is a directory"),
    CliCase("reports", "--plot x.txt", ("bench", "--config", "{tiny}", "--plot", "{tmp}/x.txt"), 2, r"unknown image format 'txt'"),
    CliCase("reports", "--plot x.pdf is a PDF", ("bench", "--config", "{tiny}", "--steps", "1", "--plot", "{tmp}/x.pdf"), 0, "", check=setups.magic("x.pdf", b"%PDF")),
    # -- memory, before it hurts
    CliCase("memory", "8B shapes, huge cache, on the CPU: refused", ("capture", "--config", "{tmp}/huge.yaml"), 2, r"memory estimate [\d.]+ GiB does not fit in the [\d.]+ .iB (host RAM|left under).*largest part is kv cache 256\.0 GiB, sized by kv_cache\.num_blocks", setups.huge_yaml, skip=setups.huge_fits),
    CliCase("memory", "a T x 2**40 float64 engine buffer: refused by the estimate", ("capture", "--config", "{tmp}/hugebuf.yaml"), 2, r"does not fit .*the largest part is buffers 128\.0 TiB, sized by .*the buffers: list", setups.huge_buffer),
    CliCase("memory", "capture's first log line is the estimate", _CAP, 0, r"memory estimate", check=setups.first_log_line_has_estimate),
    CliCase("memory", "sizes shows the estimate", ("sizes", "--config", "{tiny}"), 0, r"^$", check=setups.out_has("memory estimate")),
    CliCase("memory", "a factory's own estimate is used", (*_CAP, "--set", f"model.factory={_FACTORY}:estimated_factory"), 0, r"memory estimate .*checkpoint 3\.0 MiB"),
    # -- packaging and names
    CliCase("packaging", "factory override replaces the default name", ("sizes", "--set", f"model.factory={_FACTORY}:raising_factory"), 0, r"^$"),
    CliCase("packaging", "vLLM mode FULL_DECODE_ONLY", ("validate", "{tiny}", "--set", "capture.mode=FULL_DECODE_ONLY"), 0, r"^$"),
    CliCase("packaging", "unknown mode lists graphcap's", ("validate", "{tiny}", "--set", "capture.mode=CASCADE"), 2, "", check=setups.out_has("expected none | full | full_decode_only | piecewise | full_and_piecewise; got 'CASCADE'")),
)  # fmt: skip
"""Every case, in the order of docs/RELIABILITY.md."""
