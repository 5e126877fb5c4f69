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
import errno
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from graphcap.config import MAX_CONFIG_BYTES

__all__ = ["CLI_CASES", "CliCase", "CliResult", "check_case", "run_case"]

_TINY = {
    "device": "cpu",
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 128},
    "batching": {"max_num_seqs": 4, "max_num_tokens": 16},
    "kv_cache": {"block_size": 4, "num_blocks": 40, "max_model_len": 32},
    "capture": {"sizes": [2, 4], "num_warmups": 1},
}
# An 8B-shaped model with a cache no machine holds: refused on any realistic host.
_HUGE = {
    "model": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "vocab_size": 128256},
    "model_extra": {"intermediate_size": 14336, "dtype": "bfloat16"},
    "kv_cache": {"block_size": 16, "num_blocks": 131072, "max_model_len": 2048},
    "batching": {"max_num_seqs": 256, "max_num_tokens": 2048},
    "capture": {"max_size": 512},
}


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
    """A file to give the command as its stdout (`/dev/full`)."""


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


def run_case(case: CliCase, tmp: Path) -> CliResult:
    """Write the case's files under `tmp` and run the command in-process."""
    from graphcap.cli import main

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(_TINY, sort_keys=False))
    if case.setup is not None:
        case.setup(tmp)
    argv = [arg.format(tmp=tmp, tiny=tmp / "tiny.yaml") for arg in case.argv]
    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        out: Any = stack.enter_context(open(case.stdout, "w")) if case.stdout else io.StringIO()
        stack.enter_context(contextlib.redirect_stdout(out))
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


# -- factories the cases point model.factory at -------------------------------------------


def raising_factory(config: Any) -> Any:
    raise ValueError("checkpoint /models/llama/consolidated.00.pth is missing")


def _tiny_llama(config: Any) -> Any:
    from dataclasses import replace

    from graphcap.models import build_model

    return build_model(replace(config, model=replace(config.model, factory=None, name="tiny-llama")))


def unsafe_factory(config: Any) -> Any:
    """A model whose forward reads a device value on the host: no key can be captured."""
    model = _tiny_llama(config)
    forward = model.forward

    def read_a_value(inputs: Any) -> Any:
        out = forward(inputs)
        return out * float(out[0, 0] > 0)  # .item() in disguise: capture-unsafe

    model.forward = read_a_value
    return model


def estimated_factory(config: Any) -> Any:
    return _tiny_llama(config)


estimated_factory.estimate_memory = lambda config: {"checkpoint": 3 << 20}  # type: ignore[attr-defined]


# -- setups and checks ------------------------------------------------------------------------


def _write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


def _symlink_loop(tmp: Path) -> None:
    for a, b in (("a.yaml", "b.yaml"), ("b.yaml", "a.yaml")):
        with contextlib.suppress(FileExistsError):
            (tmp / a).symlink_to(tmp / b)


def _chmod_zero(tmp: Path) -> None:
    (tmp / "secret.yaml").write_text("device: cpu\n")
    (tmp / "secret.yaml").chmod(0)


def _self_report(tmp: Path) -> None:
    doc = {**_TINY, "report": {"path": str(tmp / "self.yaml")}}
    (tmp / "self.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _unchanged(name: str) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        if yaml.safe_load((tmp / name).read_text()).get("model") != _TINY["model"]:
            raise AssertionError(f"{name} was overwritten")

    return check


def _report_mode(expected: int | None) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        umask = os.umask(0)
        os.umask(umask)
        want = (0o666 & ~umask) if expected is None else expected
        mode = (tmp / "report.json").stat().st_mode & 0o777
        if mode != want:
            raise AssertionError(f"report mode {mode:o}, expected {want:o}")

    return check


def _report_contents(tmp: Path, out: str, err: str) -> None:
    data = json.loads((tmp / "report.json").read_text())
    env = data["environment"]
    for key in ("graphcap", "python", "torch", "cuda_runtime", "device_name"):
        if key not in env:
            raise AssertionError(f"environment lacks {key}")
    if not data["command"].startswith("graphcap capture --config") or not data["created"].endswith("+00:00"):
        raise AssertionError(f"command {data['command']!r} or timestamp {data['created']!r}")
    if not re.fullmatch(r"[0-9a-f]{16}", data["config_fingerprint"]):
        raise AssertionError(f"fingerprint {data['config_fingerprint']!r}")
    if "upper bound" not in data["memory_meaning"]["pool_bytes"]:
        raise AssertionError("the emulated memory total is not labelled")


def _table_printed(tmp: Path, out: str, err: str) -> None:
    if "graphs captured:" not in out:
        raise AssertionError("the capture table was lost")


def _first_log_line_has_estimate(tmp: Path, out: str, err: str) -> None:
    first = err.splitlines()[0]
    if "memory estimate" not in first or "weights" not in first:
        raise AssertionError(f"first log line: {first!r}")


def _out_has(text: str) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        if text not in out + err:
            raise AssertionError(f"{text!r} not in the output")

    return check


def _magic(name: str, magic: bytes) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        data = (tmp / name).read_bytes()
        if not data.startswith(magic):
            raise AssertionError(f"{name} starts with {data[:8]!r}, not {magic!r}")
        if [p.name for p in tmp.iterdir() if p.name.startswith(f".{name}")]:
            raise AssertionError("a temporary file was left")

    return check


@contextlib.contextmanager
def _disk_full() -> Iterator[None]:
    real = os.fsync

    def fail(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = fail
    try:
        yield
    finally:
        os.fsync = real


def _root() -> str | None:
    return "root reads any file" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def _missing(path: str) -> Callable[[], str | None]:
    return lambda: None if os.path.exists(path) else f"no {path} here"


def _with_cuda() -> str | None:
    import torch

    return "CUDA is available here" if torch.cuda.is_available() else None


def _overcommit_always() -> str | None:
    try:
        with open("/proc/sys/vm/overcommit_memory") as handle:
            always = handle.read().strip() == "1"
    except OSError:
        return "cannot tell whether a 4 TiB allocation fails at once here"
    return "the kernel overcommits every allocation" if always else None


def _huge_fits() -> str | None:
    from graphcap.config import load_config
    from graphcap.memory import available_memory, estimate_memory

    config = load_config(overrides={**_huge_overrides(), "device": "cpu"})
    available, _ = available_memory("cpu")
    too_big = available is not None and estimate_memory(config).total > available
    return None if too_big else "this machine could hold the huge config"


def _huge_overrides() -> dict[str, Any]:
    flat = {f"model.{k}": v for k, v in {**_HUGE["model"], **_HUGE["model_extra"]}.items()}
    for section in ("kv_cache", "batching", "capture"):
        flat.update({f"{section}.{k}": v for k, v in _HUGE[section].items()})
    return flat


def _huge_yaml(tmp: Path) -> None:
    doc: dict[str, Any] = {"device": "cpu"}
    for dotted, value in _huge_overrides().items():
        section, _, key = dotted.partition(".")
        doc.setdefault(section, {})[key] = value
    (tmp / "huge.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


_CAP = ("capture", "--config", "{tiny}", "--no-progress")
_FACTORY = "graphcap.testing.cli_cases"

CLI_CASES: tuple[CliCase, ...] = (
    # -- files and flags: one line, exit 2 (exit 1 for a failure of the run itself)
    CliCase("files", "config: symlink loop", ("sizes", "--config", "{tmp}/a.yaml"), 2, r"\(ELOOP\)", _symlink_loop),
    CliCase("files", "config: not a directory", ("sizes", "--config", "{tiny}/x.yaml"), 2, r"\(ENOTDIR\)"),
    CliCase("files", "config: name too long", ("sizes", "--config", "{tmp}/" + "x" * 300), 2, r"\(ENAMETOOLONG\)"),
    CliCase("files", "config: a directory", (*_CAP[:2], "{tmp}"), 2, r"cannot read .*: Is a directory \(EISDIR\)"),
    CliCase("files", "config: I/O error", ("sizes", "--config", "/proc/self/mem"), 2, r"\(EIO\)", skip=_missing("/proc/self/mem")),
    CliCase("files", "config: permission denied", ("sizes", "--config", "{tmp}/secret.yaml"), 2, r"Permission denied \(EACCES\)", _chmod_zero, skip=_root),
    CliCase("files", "config: /dev/zero", ("sizes", "--config", "/dev/zero"), 2, r"is larger than 1 MiB", skip=_missing("/dev/zero")),
    CliCase("files", "config: a 3 MB list", ("sizes", "--config", "{tmp}/list.yaml"), 2, r"larger than 1 MiB", _write("list.yaml", "x:\n" + "- 1\n" * (3 << 18))),
    CliCase("files", "config: 20 MB of comments", ("sizes", "--config", "{tmp}/c.yaml"), 2, r"larger than 1 MiB", _write("c.yaml", "#" * (20 << 20))),
    CliCase("files", "config: 350k nodes under 1 MiB", ("sizes", "--config", "{tmp}/n.yaml"), 2, r"more than 16384 values", _write("n.yaml", "x: [" + "1, " * ((MAX_CONFIG_BYTES - 16) // 3) + "1]")),
    CliCase("files", "config: not UTF-8", ("sizes", "--config", "{tmp}/l1.yaml"), 2, r"not UTF-8 text: byte 0xe9", _write("l1.yaml", b"model: {name: caf\xe9}\n")),
    CliCase("files", "config: 5000-digit integer", ("sizes", "--config", "{tmp}/i.yaml"), 2, r"model\.seed: integer too long \(5000 digits", _write("i.yaml", "model: {seed: " + "7" * 5000 + "}\n")),
    CliCase("flags", "--set: 5000-digit integer", ("sizes", "--set", "model.seed=" + "7" * 5000), 2, r"--set 'model\.seed=7{40,}\.\.\.': integer too long"),
    CliCase("flags", "--set: quoted value loses its quotes", ("validate", "{tiny}", "--set", 'model.name="tiny-llama"'), 0, r"^$", check=_out_has(": ok")),
    CliCase("flags", "--set: quoted number stays a string", ("validate", "{tiny}", "--set", "capture.max_size='4'"), 2, r"^1 of 1", check=_out_has("a quoted number is a string")),
    CliCase("flags", "seed >= 2**64", ("validate", "{tiny}", "--set", f"model.seed={2**64}"), 2, "", check=_out_has("model.seed: must be <= 18446744073709551615")),
    CliCase("flags", "hidden_size 1M", ("validate", "{tiny}", "--set", "model.hidden_size=1048576"), 2, "", check=_out_has("model.hidden_size: must be <= 65536")),
    CliCase("flags", "max_num_tokens 2**31-1", ("validate", "{tiny}", "--set", "batching.max_num_tokens=2147483647"), 2, "", check=_out_has("must be <= 16777216")),
    CliCase("flags", "model build fails: key and cause named", (*_CAP, "--skip-memory-check", "--set", "model.hidden_size=65536", "--set", "model.num_heads=512", "--set", "model.vocab_size=16777216"), 1, r"building model tiny-llama failed: (RuntimeError|OutOfMemoryError): .*weights .* by model\.hidden_size", skip=_overcommit_always),
    CliCase("flags", "factory raises: one line", (*_CAP, "--set", f"model.factory={_FACTORY}:raising_factory"), 1, rf"failed: model\.factory {_FACTORY}:raising_factory raised ValueError: checkpoint /models"),
    CliCase("flags", "sizes --max-size 10**8", ("sizes", "--max-size", "100000000"), 2, r"--max-size: must be <= 65536; got 100000000"),
    CliCase("flags", "sizes --max-size 10**9", ("sizes", "--max-size", "1000000000"), 2, r"--max-size: must be <= 65536"),
    CliCase("flags", "histogram: not UTF-8", ("sizes", "--histogram", "{tmp}/h.txt"), 2, r"h\.txt:2: not UTF-8 text \(byte 0xff\)", _write("h.txt", b"4\n\xff\xfe\n")),
    CliCase("flags", "histogram: /dev/zero", ("sizes", "--histogram", "/dev/zero"), 2, r"/dev/zero:1: line longer than 4096 bytes", skip=_missing("/dev/zero")),
    CliCase("flags", "histogram: weights sum to infinity", ("sizes", "--histogram", "{tmp}/h.txt"), 2, r"the counts sum to inf; scale them down", _write("h.txt", "4 1e308\n8 1e308\n")),
    CliCase("flags", "sizes > /dev/full", ("sizes",), 1, r"^graphcap sizes: failed: cannot write the output to stdout: No space left on device\n$", stdout="/dev/full", skip=_missing("/dev/full")),
    CliCase("flags", "--backend cuda without CUDA", (*_CAP, "--backend", "cuda"), 2, r"--backend cuda: CUDA is not available", skip=_with_cuda),
    CliCase("flags", "--device cuda without CUDA", (*_CAP, "--device", "cuda"), 2, r"'cuda' requested but CUDA is not available", skip=_with_cuda),
    CliCase("flags", "on_error skip, every key skipped", (*_CAP, "--set", "capture.on_error=skip", "--set", f"model.factory={_FACTORY}:unsafe_factory"), 1, r"nothing was captured: all 4 keys were skipped", check=_table_printed),
    # -- reports and plots
    CliCase("reports", "--report is the --config file", (*_CAP, "--report", "{tiny}"), 2, r"is the config file itself", check=_unchanged("tiny.yaml")),
    CliCase("reports", "report.path is its own config file", ("capture", "--config", "{tmp}/self.yaml"), 2, r"is the config file itself", _self_report, check=_unchanged("self.yaml")),
    CliCase("reports", "report replaces a 0640 file: mode kept", (*_CAP, "--report", "{tmp}/report.json"), 0, "", lambda tmp: (_write("report.json", "{}")(tmp), (tmp / "report.json").chmod(0o640)), check=_report_mode(0o640)),
    CliCase("reports", "new report: 0666 under the umask", (*_CAP, "--report", "{tmp}/report.json"), 0, "", check=_report_mode(None)),
    CliCase("reports", "report write fails: table, then one line", (*_CAP, "--report", "{tmp}/report.json"), 1, r"cannot write the report to .*report\.json: No space left on device", check=_table_printed, patch=_disk_full),
    CliCase("reports", "report says where and how it was made", (*_CAP, "--report", "{tmp}/report.json"), 0, "", check=_report_contents),
    CliCase("reports", "--plot into a directory", ("bench", "--config", "{tiny}", "--plot", "{tmp}"), 2, r"--plot .*: is a directory"),
    CliCase("reports", "--plot x.txt", ("bench", "--config", "{tiny}", "--plot", "{tmp}/x.txt"), 2, r"unknown image format 'txt'"),
    CliCase("reports", "--plot x.pdf is a PDF", ("bench", "--config", "{tiny}", "--steps", "1", "--plot", "{tmp}/x.pdf"), 0, "", check=_magic("x.pdf", b"%PDF")),
    # -- memory, before it hurts
    CliCase("memory", "8B shapes, huge cache, on the CPU: refused", ("capture", "--config", "{tmp}/huge.yaml"), 2, r"memory estimate [\d.]+ GiB does not fit in the [\d.]+ .iB (host RAM|left under).*largest part is kv cache 256\.0 GiB, sized by kv_cache\.num_blocks", _huge_yaml, skip=_huge_fits),
    CliCase("memory", "capture's first log line is the estimate", _CAP, 0, r"memory estimate", check=_first_log_line_has_estimate),
    CliCase("memory", "sizes shows the estimate", ("sizes", "--config", "{tiny}"), 0, r"^$", check=_out_has("memory estimate")),
    CliCase("memory", "a factory's own estimate is used", (*_CAP, "--set", f"model.factory={_FACTORY}:estimated_factory"), 0, r"memory estimate .*checkpoint 3\.0 MiB"),
    # -- packaging and names
    CliCase("packaging", "factory override replaces the default name", ("sizes", "--set", f"model.factory={_FACTORY}:raising_factory"), 0, r"^$"),
    CliCase("packaging", "vLLM mode FULL_DECODE_ONLY", ("validate", "{tiny}", "--set", "capture.mode=FULL_DECODE_ONLY"), 0, r"^$"),
    CliCase("packaging", "unknown mode lists graphcap's", ("validate", "{tiny}", "--set", "capture.mode=CASCADE"), 2, "", check=_out_has("expected none | full | full_decode_only | piecewise | full_and_piecewise; got 'CASCADE'")),
)  # fmt: skip
"""Every case, in the order of docs/RELIABILITY.md."""
