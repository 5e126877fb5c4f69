"""`CaptureReport`: what a capture pass did, per graph; JSON/YAML and a text table (records and serialisation).

Besides the records, a report says where it was made (graphcap, torch, CUDA and driver
versions, the device's name, a UTC timestamp, the command line when the CLI made it and the
config's fingerprint), so two reports can be told apart and compared, and it labels what
each memory number measures: the CUDA pool and the emulated backend count differently.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import platform
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from graphcap.config.byte_counts import format_bytes
from graphcap.config.fingerprint import config_fingerprint
from graphcap.errors import CaptureError, ConfigError, ConfigProblem
from graphcap.keys import GraphKey
from graphcap.version import version

__all__ = [
    "MEMORY_MEANING",
    "CaptureReport",
    "REPORT_MARKER",
    "GraphRecord",
    "atomic_write",
    "check_report_path",
    "environment",
    "may_overwrite",
    "write_report",
]

REPORT_MARKER = "graphcap_report"
"""The first key of every report graphcap writes (its value is the report format's version,
`REPORT_FORMAT`). graphcap replaces an existing file only when it starts with this key."""
REPORT_FORMAT = 1

MEMORY_MEANING = {
    "cuda": {
        "pool_bytes": "graph pool: growth of the shared CUDA graph memory pool over the pass (what the graphs "
        "hold together)",
        "memory_bytes": "memory: device memory the capture of this graph took from the shared pool (allocator delta)",
    },
    "emulated": {
        "pool_bytes": "replay peaks: sum over graphs of memory_bytes, an upper bound, not a process peak (emulated "
        "graphs share no pool and replay one at a time: the process holds every output plus one replay's peak)",
        "memory_bytes": "memory: peak of live intermediates during one replay of this graph, plus its static output",
    },
}
"""What the memory numbers of a report measure, per backend (written into every report); each
starts with the name the summary and the README give it."""


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One key of a capture pass."""

    key: GraphKey
    status: Literal["captured", "skipped"]
    capture_seconds: float
    """Wall time of staging, warmups, capture and verification for this key."""
    memory_bytes: int
    """Memory the graph took (see `MEMORY_MEANING` for what each backend counts)."""
    verified: bool
    """Replayed once after capture and matched an eager run on the same inputs."""
    reason: str = ""
    """Why a skipped key was skipped."""
    eager_seconds: float = 0.0
    """Of capture_seconds, the time spent in eager forwards (warmups and the verification run)."""
    latency: dict[str, Any] | None = None
    """Step latency where it was measured (`graphcap bench`): milliseconds per step of `eager` and
    `replay` (each `median`, `p10`, `p90`, `iqr`, `samples`) and `noisy`; None when not measured."""
    pieces: int = 0
    """Graphs one replay of this key launches: 1 for a full graph, the piece count of a piecewise
    key; 0 when skipped."""
    eager_ops: int = 0
    """`eager_op` calls a replay runs between the pieces (0 for a full graph)."""
    speedup: float | None = None
    """Eager over replay time of the key's dummy batch at capture: one run each (verification), or with
    `capture.min_speedup` the medians of a few interleaved runs; None when neither ran."""
    verified_fills: tuple[tuple[int, int], ...] = ()
    """(real tokens, real requests) of each probe batch the replay matched an eager run on (besides the dummy
    batch): partly filled at several levels, or the key's own counts alone when no smaller batch fits the key."""

    @property
    def full_batch_only(self) -> bool:
        """Verified, but on full batches only: the key admits no smaller batch (one request of a uniform key)."""
        T, R = self.key.num_tokens, self.key.num_reqs  # R None: a piecewise key holds any request count
        return self.verified and all(n == T and R in (None, r) for n, r in self.verified_fills)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verified_fills"] = [list(fill) for fill in self.verified_fills]
        out["key"] = {
            "num_tokens": self.key.num_tokens,
            "num_reqs": self.key.num_reqs,
            "uniform": self.key.uniform,
            "piecewise": self.key.piecewise,
        }
        return out


@dataclass(slots=True)
class CaptureReport:
    """Per-graph records of one capture pass plus totals and where it ran. Written with `write(path)`.

    `created`, `environment` and `config_fingerprint` fill themselves in when not given.
    """

    records: list[GraphRecord]
    backend: str
    device: str
    total_seconds: float
    pool_bytes: int
    """Memory all graphs hold together (see `MEMORY_MEANING`: CUDA pool growth; emulated: a sum)."""
    config: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What the pass did that a reader must know beyond the records (compiled code captured uncompiled)."""
    created: str = ""
    """UTC time the report was made (ISO 8601)."""
    environment: dict[str, Any] = field(default_factory=dict)
    """graphcap, Python, torch, CUDA runtime and driver versions, the device's name (see `environment`)."""
    command: str | None = None
    """The command line that made the report (set by the CLI)."""
    config_fingerprint: str = ""
    """`graphcap.config.fingerprint.config_fingerprint` of `config`: equal configs, equal fingerprints."""
    recapture: dict[str, Any] | None = None
    """A re-capture (None for a manager's first pass): `pass` (its number), `after` (what freed the
    graphs before it: `capture()` replacing them, `release()`, `resize_kv()` or `reset()`),
    `graphs_released` (how many) and `reused` (what the pass kept rather than rebuilt)."""
    pending: list[str] = field(default_factory=list)
    """Keys left for `capture_pending()` (`capture.strategy: lazy`)."""
    memory_budget: dict[str, Any] | None = None
    """With `capture.memory_budget`: `budget_bytes`, `estimate_bytes`, measured `pool_bytes`, `reserved_bytes`."""

    def __post_init__(self) -> None:
        if not self.created:
            self.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if not self.environment:
            self.environment = environment(self.device)
        if not self.config_fingerprint and self.config:
            self.config_fingerprint = config_fingerprint(self.config)

    @property
    def captured(self) -> list[GraphRecord]:
        return [r for r in self.records if r.status == "captured"]

    @property
    def skipped(self) -> list[GraphRecord]:
        return [r for r in self.records if r.status == "skipped"]

    @property
    def largest_graph_bytes(self) -> int:
        return max((r.memory_bytes for r in self.captured), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            REPORT_MARKER: REPORT_FORMAT,  # first: what `may_overwrite` looks for
            "created": self.created,
            "command": self.command,
            "environment": self.environment,
            "backend": self.backend,
            "device": self.device,
            "total_seconds": self.total_seconds,
            "num_graphs": len(self.captured),
            "num_skipped": len(self.skipped),
            "pool_bytes": self.pool_bytes,
            "largest_graph_bytes": self.largest_graph_bytes,
            "memory_meaning": MEMORY_MEANING.get(self.backend, {}),
            "graphs": [r.to_dict() for r in self.records],
            "warnings": list(self.warnings),
            "recapture": self.recapture,
            "pending": list(self.pending),
            "memory_budget": self.memory_budget,
            "config_fingerprint": self.config_fingerprint,
            "config": self.config,
        }

    def write(self, path: str | os.PathLike) -> Path:
        """Write JSON (`.json`) or YAML (`.yaml`/`.yml`) atomically: complete or absent (see `atomic_write`).

        Raises `FileExistsError` when `path` is a file graphcap did not write (see `may_overwrite`).
        """
        path = Path(path)
        if not may_overwrite(path):
            why = f"exists and is not a graphcap report (no {REPORT_MARKER!r} key first); not replaced"
            raise FileExistsError(errno.EEXIST, why, str(path))
        data = self.to_dict()
        if path.suffix == ".json":
            text = json.dumps(data, indent=2) + "\n"
        elif path.suffix in (".yaml", ".yml"):
            text = yaml.safe_dump(data, sort_keys=False)
        else:
            raise ValueError(f"report path must end in .json, .yaml or .yml; got {str(path)!r}")
        atomic_write(path, text)
        return path

    def table(self) -> str:
        """A fixed-width table, one row per key, largest first (the capture order)."""
        rows = [f"{'key':<9} {'tokens':>6} {'reqs':>5} {'capture ms':>10} {'memory':>10} {'verified':>8}  note"]
        for r in self.records:
            kind = "piecewise" if r.key.piecewise else "uniform" if r.key.uniform else "mixed"
            reqs = "any" if r.key.piecewise else r.key.num_reqs
            verified = "yes" if r.verified else ("-" if r.status == "captured" else "no")
            note = f"skipped: {r.reason}" if r.status == "skipped" else ""
            if r.key.piecewise and r.status == "captured":
                note = f"{r.pieces} pieces around {r.eager_ops} eager ops"
            if r.full_batch_only:
                note = "verified on the full batch only (no smaller batch fits the key)"
            rows.append(
                f"{kind:<9} {r.key.num_tokens:>6} {reqs:>5} {r.capture_seconds * 1e3:>10.1f} "
                f"{format_bytes(r.memory_bytes):>10} {verified:>8}  {note}".rstrip()
            )
        return "\n".join(rows)

    def summary(self) -> str:
        """Totals in a few lines: graphs, time, memory (labelled by what it measures), skipped sizes."""
        if self.backend == "cuda":
            memory = f"graph pool: {format_bytes(self.pool_bytes)} (growth of the shared CUDA graph pool)"
        else:
            memory = (
                f"replay peaks: {format_bytes(self.pool_bytes)} (each graph's replay peak and output, summed; "
                "an upper bound: emulated graphs replay one at a time)"
            )
        lines = [
            f"graphs captured: {len(self.captured)} of {len(self.records)} keys "
            f"({self.backend} backend on {self.device})",
            f"total capture time: {self.total_seconds:.2f} s",
            f"{memory}; largest graph {format_bytes(self.largest_graph_bytes)}",
        ]
        if self.recapture:
            again = self.recapture
            lines.append(
                f"re-capture (pass {again['pass']}) after {again['after']}, which released {again['graphs_released']} "
                f"graphs; kept: {', '.join(again['reused'])}"
            )
        if self.skipped:
            skipped = ", ".join(f"{r.key}" for r in self.skipped)
            lines.append(f"skipped ({len(self.skipped)}, these sizes run eagerly): {skipped}")
        lines += [f"pending ({len(self.pending)}): capture_pending() captures them"] if self.pending else []
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def write_report(report: CaptureReport, path: str, *, undo: Callable[[], object]) -> None:
    """Write a pass's report; if that fails, `undo()` the pass (it is all or nothing) and raise `CaptureError`.

    A `KeyboardInterrupt` or `SystemExit` propagates unchanged after the undo.
    """
    try:
        report.write(path)
    except BaseException as exc:
        undo()
        if not isinstance(exc, Exception):
            raise
        raise CaptureError(
            f"captured {len(report.captured)} graphs, but writing the report to {path} failed "
            f"({type(exc).__name__}: {exc}); the graphs were released, the old report is unchanged"
        ) from exc


def environment(device: str) -> dict[str, Any]:
    """Versions and the device's name, for a report: what a bug report or a comparison needs."""
    import torch

    out: dict[str, Any] = {
        "graphcap": version(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda_runtime": torch.version.cuda,
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index
        out["device_name"] = torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)
        driver_api = getattr(torch._C, "_cuda_getDriverVersion", None)  # CUDA driver API version, e.g. 12040
        out["cuda_driver_api"] = driver_api() if callable(driver_api) else None
        out["nvidia_driver"] = _nvidia_driver()
    else:
        out["device_name"] = _cpu_name()
    return out


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as handle:  # "NVRM version: NVIDIA UNIX ... 550.54.15 ..."
            words = handle.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), None)


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def check_report_path(path: str | os.PathLike, *, not_same_as: tuple[str | os.PathLike, ...] = ()) -> None:
    """Refuse, before any work, a report path that cannot be written or must not be.

    Raises `ConfigError` (key `report.path`) when `path` is a directory, lies under a file, is
    in a directory without write permission, cannot be used at all (a name too long, a loop of
    links), is the same file as one of `not_same_as` (the config the report describes), or is
    an existing file that graphcap did not write (see `may_overwrite`).
    """
    target = Path(path)
    try:
        problem = _path_problem(path, target, not_same_as)
    except OSError as exc:  # ENAMETOOLONG, ELOOP, EACCES on a parent, ...
        problem = f"{path} cannot be used: {_os_reason(exc)}"
    if problem:
        raise ConfigError([ConfigProblem("report.path", problem)])


def _path_problem(path: str | os.PathLike, target: Path, not_same_as: tuple[str | os.PathLike, ...]) -> str | None:
    if target.is_dir():
        return f"{path} is a directory; give a file name ending in .json, .yaml or .yml"
    if target.exists() and any(Path(o).exists() and os.path.samefile(target, o) for o in not_same_as):
        return f"{path} is the config file itself; writing the report there would overwrite it: pick another path"
    if (target.exists() or target.is_symlink()) and not may_overwrite(target):
        return (
            f"{path} exists and is not a graphcap report (graphcap overwrites only files that start with its "
            f"{REPORT_MARKER!r} key, or empty ones): remove it or pick another path"
        )
    parent = target.parent
    while not parent.exists() and parent != parent.parent:  # the directories write() would create
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be written: no write permission in {parent}"
    return None


def may_overwrite(path: str | os.PathLike) -> bool:
    """Whether graphcap may replace the file at `path`: it does not exist, is empty, or is a report
    graphcap wrote (a regular file whose first key is `REPORT_MARKER`). Anything else, a link, a
    device or a file some other program wrote, is left alone."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISREG(info.st_mode):
        return False
    if info.st_size == 0:
        return True
    with open(path, "rb") as handle:
        head = handle.read(256)
    return _MARKED.match(head) is not None


_MARKED = re.compile(rb'\s*(\{\s*"' + REPORT_MARKER.encode() + rb'"\s*:|' + REPORT_MARKER.encode() + rb"\s*:)")


def _os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or str(exc)
    return f"{reason} ({name})" if name else reason


def atomic_write(path: Path | str, data: str | bytes) -> None:
    """Write `data` to `path` via a temporary file and `os.replace`: never half-written.

    The file keeps the mode of the file it replaces; a new file gets 0666 under the umask
    (usually 0644), like any file an editor writes. On any failure (also `KeyboardInterrupt`)
    the temporary file is removed and the old file is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never follow a planted link or reuse a file; 0o666 lets the kernel apply the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
