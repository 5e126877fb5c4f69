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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from graphcap.config.byte_counts import format_bytes
from graphcap.config.fingerprint import config_fingerprint
from graphcap.errors import CaptureError
from graphcap.keys import GraphKey
from graphcap.report_files import REPORT_MARKER, atomic_write, may_overwrite
from graphcap.version import version

__all__ = [
    "MEMORY_MEANING",
    "CaptureReport",
    "GraphRecord",
    "environment",
    "write_report",
]

REPORT_FORMAT = 1
"""The value of a report's first key, `REPORT_MARKER` (`graphcap.report_files`): the format's version."""

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
            "axes": dict(self.key.axes),
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

    def write(self, path: str | os.PathLike[str]) -> Path:
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
        """A fixed-width table, one row per key, largest first (the capture order); a column per key axis."""
        names = list(dict.fromkeys(name for r in self.records for name, _ in r.key.axes))
        widths = [max(len(name), 5) for name in names]
        axes = "".join(f" {name:>{w}}" for name, w in zip(names, widths))
        rows = [f"{'key':<9} {'tokens':>6} {'reqs':>5}{axes} {'capture ms':>10} {'memory':>10} {'verified':>8}  note"]
        for r in self.records:
            kind = "piecewise" if r.key.piecewise else "uniform" if r.key.uniform else "mixed"
            reqs = "any" if r.key.piecewise else r.key.num_reqs
            verified = "yes" if r.verified else ("-" if r.status == "captured" else "no")
            note = f"skipped: {r.reason}" if r.status == "skipped" else ""
            if r.key.piecewise and r.status == "captured":
                note = f"{r.pieces} pieces around {r.eager_ops} eager ops"
            if r.full_batch_only:
                note = "verified on the full batch only (no smaller batch fits the key)"
            values = dict(r.key.axes)
            axes = "".join(f" {values.get(name, '-'):>{w}}" for name, w in zip(names, widths))
            rows.append(
                f"{kind:<9} {r.key.num_tokens:>6} {reqs:>5}{axes} {r.capture_seconds * 1e3:>10.1f} "
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

    from graphcap.backends.cuda_driver import cuda_driver_api

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
        out["cuda_driver_api"], missing = cuda_driver_api()  # the driver's CUDA API version, e.g. 13000
        if missing is not None:
            out["cuda_driver_api_missing"] = missing
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
