"""Every public exception of graphcap, in one leaf module (it imports nothing of graphcap).

| exception | base | raised when |
|---|---|---|
| `ConfigError` | `ValueError` | a config has problems; `.problems` lists every one (`ConfigProblem`) |
| `ConfigFileNotFoundError` | `ConfigError`, `FileNotFoundError` | the config file does not exist |
| `BatchError` | `ValueError` | a step is refused before anything is written (it does not fit the buffers or the key) |
| `InvariantViolation` | `RuntimeError` | staged metadata breaks a rule; `.field`, `.index`, `.expected`, `.actual` |
| `CaptureError` | `RuntimeError` | a graph could not be captured or replayed |
| `CaptureUnsafeError` | `CaptureError` | an op a CUDA graph cannot hold; `.op`, `.location`, `.reason` |
| `StaticInputMovedError` | `CaptureError` | a tensor a graph reads moved or was replaced after capture |
| `DistributedTimeoutError` | `CaptureError` | an agreement with peers or a step's collective failed, or out of step |
| `ReplayMismatchError` | `CaptureError` | a sampled step (`checks.sample_every`) replayed other values than eager |

Import them from here (or from `graphcap`, the package face).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "BatchError",
    "CaptureError",
    "CaptureUnsafeError",
    "ConfigError",
    "ConfigFileNotFoundError",
    "ConfigProblem",
    "DistributedTimeoutError",
    "InvariantViolation",
    "ReplayMismatchError",
    "StaticInputMovedError",
]


class ConfigProblem(NamedTuple):
    """One thing wrong with a config: the dotted key and a message with value and fix."""

    key: str
    message: str
    where: str | None = None
    """`file:line` when the YAML gives one, `override` for an override, else None."""
    involves: tuple[str, ...] = ()
    """Other sections a cross-section problem depends on (a problem about `capture.max_size`
    that compares it with `batching.max_num_tokens` involves `batching`). The loader drops it
    when one of them failed on its own, so every problem it reports is real."""

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.key}: {self.message}"


class ConfigError(ValueError):
    """Every problem found in a config, at once. `.problems` lists them in file order."""

    def __init__(self, problems: list[ConfigProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        head += f" in {source}" if source else " in the config"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The config file does not exist: a `ConfigError` (key `<file>`) like every other unreadable
    file, and a `FileNotFoundError` for code that catches that."""

    def __str__(self) -> str:
        return str(self.args[0])  # the problems, not OSError's "[Errno 2] ..." form


class BatchError(ValueError):
    """A step refused before any buffer or KV-cache slot was written.

    The message names the field, the request (or token) index, the value and the fix. It is
    a `ValueError`, so code that caught `ValueError` before keeps working; catch `BatchError`
    to tell a refused step from a bug.
    """


class InvariantViolation(RuntimeError):
    """Staged metadata broke a rule. `.field`, `.index`, `.expected`, `.actual` say where."""

    def __init__(self, field: str, index: Any, expected: Any, actual: Any, why: str, key: Any = None) -> None:
        self.field, self.index, self.expected, self.actual = field, index, expected, actual
        self.why, self.key = why, key
        where = f"{field}[{index}]" if index is not None else field
        suffix = f" (key {key})" if key is not None else ""
        super().__init__(f"{where} is {actual}, expected {expected}: {why}{suffix}")


class CaptureError(RuntimeError):
    """A graph could not be captured or replayed (misuse, failed capture, released graph)."""


class CaptureUnsafeError(CaptureError):
    """An op that CUDA graph capture cannot hold, named with its reason and the user's file:line.

    Attributes: `op` (e.g. "aten.nonzero" or "Tensor.item"), `location` ("path:line"),
    `reason` (why a CUDA graph cannot hold it), `fix` (what to write instead).
    """

    def __init__(self, op: str, location: str, reason: str, fix: str) -> None:
        super().__init__(f"{op} at {location}: {reason}. {fix}.")
        self.op = op
        self.location = location
        self.reason = reason
        self.fix = fix


class StaticInputMovedError(CaptureError):
    """A static input's address differs from the one recorded at capture (or it is missing/new).

    Attributes: `input_name`, `recorded_ptr` and `current_ptr` (None where the input is
    missing now, respectively was absent at capture).
    """

    def __init__(
        self,
        message: str,
        input_name: str,
        recorded_ptr: int | None,
        current_ptr: int | None,
    ) -> None:
        super().__init__(message)
        self.input_name = input_name
        self.recorded_ptr = recorded_ptr
        self.current_ptr = current_ptr


class ReplayMismatchError(CaptureError):
    """A live step sampled by `checks.sample_every` replayed other outputs or KV-slot values than an eager run
    of the same batch: the graph of `key` no longer computes what the model does (a kernel reading a wrong
    slice at replay shapes, a host plan gone stale, memory an eager op read reused by a later capture).

    Also what capture-time verification raises when a replay of a key's graph and an eager run of the same batch
    differ (`step` 0 there; the policy settles it, `capture.on_error`).

    Attributes: `key` (the `GraphKey` replayed), `step` (the manager's replayed-step count, from 1; 0 at capture),
    `what` (the output or KV cache that differs).
    """

    def __init__(self, message: str, key: Any, step: int, what: str) -> None:
        super().__init__(message)
        self.key = key
        self.step = step
        self.what = what


class DistributedTimeoutError(CaptureError):
    """An agreement with peers or a collective of a step did not complete (a rank stopped stepping, died, or
    made another call: "ranks out of step"); the message names the step."""
