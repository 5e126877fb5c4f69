"""`CaptureReport`: what a capture pass did, per graph; JSON/YAML and a text table (records and serialisation)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from graphcap.batch import GraphKey

__all__ = ["CaptureReport", "GraphRecord", "atomic_write", "format_bytes"]


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One key of a capture pass."""

    key: GraphKey
    status: Literal["captured", "skipped"]
    capture_seconds: float
    """Wall time of staging, warmups, capture and verification for this key."""
    memory_bytes: int
    """Memory the graph took (CUDA: allocator delta in the shared pool; emulated: peak live intermediates)."""
    verified: bool
    """Replayed once after capture and matched an eager run on the same inputs."""
    reason: str = ""
    """Why a skipped key was skipped."""
    eager_seconds: float = 0.0
    """Of capture_seconds, the time spent in eager forwards (warmups and the verification run)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["key"] = {"num_tokens": self.key.num_tokens, "num_reqs": self.key.num_reqs, "uniform": self.key.uniform}
        return out


@dataclass(slots=True)
class CaptureReport:
    """Per-graph records of one capture pass plus totals. Written with `write(path)`."""

    records: list[GraphRecord]
    backend: str
    device: str
    total_seconds: float
    pool_bytes: int
    """Memory all graphs hold together (CUDA: the shared pool; emulated: sum over graphs)."""
    config: dict[str, Any] = field(default_factory=dict)

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
            "backend": self.backend,
            "device": self.device,
            "total_seconds": self.total_seconds,
            "num_graphs": len(self.captured),
            "num_skipped": len(self.skipped),
            "pool_bytes": self.pool_bytes,
            "largest_graph_bytes": self.largest_graph_bytes,
            "graphs": [r.to_dict() for r in self.records],
            "config": self.config,
        }

    def write(self, path: str | os.PathLike) -> Path:
        """Write JSON (`.json`) or YAML (`.yaml`/`.yml`) atomically: complete or absent."""
        path = Path(path)
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
        rows = [f"{'key':<8} {'tokens':>6} {'reqs':>5} {'capture ms':>10} {'memory':>10} {'verified':>8}  note"]
        for r in self.records:
            kind = "uniform" if r.key.uniform else "mixed"
            verified = "yes" if r.verified else ("-" if r.status == "captured" else "no")
            note = f"skipped: {r.reason}" if r.status == "skipped" else ""
            rows.append(
                f"{kind:<8} {r.key.num_tokens:>6} {r.key.num_reqs:>5} {r.capture_seconds * 1e3:>10.1f} "
                f"{format_bytes(r.memory_bytes):>10} {verified:>8}  {note}".rstrip()
            )
        return "\n".join(rows)

    def summary(self) -> str:
        """Totals in a few lines: graphs, time, pool memory vs the largest graph, skipped sizes."""
        lines = [
            f"graphs captured: {len(self.captured)} of {len(self.records)} keys "
            f"({self.backend} backend on {self.device})",
            f"total capture time: {self.total_seconds:.2f} s",
            f"graph memory: {format_bytes(self.pool_bytes)} in all; largest single graph "
            f"{format_bytes(self.largest_graph_bytes)}",
        ]
        if self.skipped:
            skipped = ", ".join(f"{r.key}" for r in self.skipped)
            lines.append(f"skipped ({len(self.skipped)}, these sizes run eagerly): {skipped}")
        return "\n".join(lines)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and `os.replace`: never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_bytes(num: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"
