"""The `checks:` and `report:` sections: the safety checks of every step and capture, and the report file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from graphcap.config._schema import Section, problem, spec
from graphcap.errors import ConfigProblem
from graphcap.fields import INT32_MAX

__all__ = ["ChecksConfig", "ReportConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChecksConfig(Section):
    """Safety checks on every step and after capture."""

    _key: ClassVar[str] = "checks"
    invariants: Literal["off", "basic", "full"] = "basic"
    """`basic` (O(requests), every step), `full` (adds O(tokens) checks), or `off`."""
    verify_replay: bool = True
    """After each capture, replay and compare with eager runs (the dummy batch and a partly
    filled second batch)."""
    atol: float | None = spec(None, min=0)
    """Absolute tolerance of that comparison; null uses torch.testing's default for the dtype."""
    rtol: float | None = spec(None, min=0)
    """Relative tolerance; give both or neither."""
    poison_padding: bool = False
    """Debug: fill the persistent buffers with sentinel garbage before every staging."""
    sync_debug: bool = False
    """CUDA: run warmups under `torch.cuda.set_sync_debug_mode("error")` to name host syncs."""
    sample_every: int = spec(0, min=0, max=INT32_MAX)
    """Every Nth replayed step also runs eagerly on the same batch and is compared (outputs and the KV slots
    it writes; `ReplayMismatchError` naming the key and the step); the eager run's KV writes are undone
    before the replay. 0 (the default): off."""

    def _check(self) -> list[ConfigProblem]:
        if (self.atol is None) != (self.rtol is None):
            return [
                problem(
                    "atol",
                    f"give checks.atol and checks.rtol together or neither; got atol={self.atol}, rtol={self.rtol}",
                )
            ]
        return []

    @property
    def tolerance(self) -> dict[str, float]:
        """Keyword arguments for `torch.testing.assert_close` (empty: its defaults)."""
        if self.atol is None or self.rtol is None:  # both or neither (checked)
            return {}
        return {"atol": self.atol, "rtol": self.rtol}


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportConfig(Section):
    """Where the capture report goes."""

    _key: ClassVar[str] = "report"
    path: str | None = None
    """Write the `CaptureReport` here (`.json`, `.yaml` or `.yml`), atomically; null: don't."""
    flight_steps: int = spec(0, min=0, max=1024)
    """The flight recorder: the host rows of the last N staged steps (real steps and capture batches), written
    to a post-mortem file when an error leaves `execute`, `capture` or `capture_pending`; 0 (the default): off,
    no file (about 3.5 us per step at 256 decodes, docs/BENCHMARKS.md)."""
    postmortem: str | None = None
    """Where the post-mortem goes: a `.json` path, or a directory for `graphcap-postmortem.json` (with peers
    `graphcap-postmortem.rankN.json`); null: the working directory. Never over a file graphcap did not write."""

    def _check(self) -> list[ConfigProblem]:
        if self.path is not None and Path(self.path).suffix not in (".json", ".yaml", ".yml"):
            return [problem("path", f"must end in .json, .yaml or .yml; got {self.path!r}")]
        if self.postmortem is not None and (not self.postmortem or Path(self.postmortem).suffix not in ("", ".json")):
            why = "a .json file or a directory (a name with no suffix)"
            return [problem("postmortem", f"must be {why}; got {self.postmortem!r}")]
        return []
