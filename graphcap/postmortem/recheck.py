"""Read a post-mortem file and re-check its steps, on numpy alone (no torch import).

`load_postmortem` parses and validates a file (`PostmortemFileError`, one line, for anything that
is not a post-mortem graphcap wrote); `recheck` rebuilds each step's host rows at its padded shape
and runs `check_invariants` at `full` with the KV-write rules (`dummy` and `kv_writes` as the step
was staged), plus one rule of its own: the staged `step_counts` hold the step's real counts. An
engine buffer's own `check` callable is not in the file: its pad rule is re-checked, not its check.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from graphcap.checks.invariants import check_invariants
from graphcap.config import PadRules
from graphcap.errors import InvariantViolation
from graphcap.fields import COUNTS_ENTRY, FIELDS
from graphcap.keys.key import GraphKey
from graphcap.postmortem.file import POSTMORTEM_MARKER, VERSION

if TYPE_CHECKING:
    from graphcap.inputs import ForwardInputs

__all__ = ["PostmortemFileError", "StepCheck", "load_postmortem", "recheck"]


class PostmortemFileError(ValueError):
    """The file is not a post-mortem graphcap can read (one line: what and where)."""


class StepCheck(NamedTuple):
    """One recorded step and what the re-check found."""

    position: int
    """Its place in the file (0: the oldest recorded)."""
    step: dict[str, Any]
    violation: InvariantViolation | None
    rows: dict[str, np.ndarray]
    """The step's host rows by packed field name, at its padded shape."""


@dataclass(frozen=True)
class _Limits:
    block_size: int
    max_blocks_per_req: int
    num_blocks: int | None
    vocab_size: int | None
    max_model_len: int | None
    pad: PadRules
    extras: tuple = ()
    kv_groups: tuple = ()

    @property
    def num_slots(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size


class _Group(NamedTuple):
    name: str
    block_size: int
    num_blocks: int
    max_blocks_per_req: int
    sliding_window: int | None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class _Extra(NamedTuple):
    name: str
    rows: str
    row_dim: int
    pad: Any
    check: None = None

    @property
    def is_cumulative(self) -> bool:
        return self.rows == "reqs+1"


class _GroupRows(NamedTuple):
    block_table: np.ndarray
    slot_mapping: np.ndarray


class _Inputs:
    """What `check_invariants` reads of a `ForwardInputs`, rebuilt from a recorded step."""

    __slots__ = ("basic_plan", "cumulative_plan", "host", "key", "limits", "num_reqs", "num_tokens")

    def __init__(self, host: Any, key: GraphKey, limits: _Limits, num_tokens: int, num_reqs: int) -> None:
        self.host, self.key, self.limits = host, key, limits
        self.num_tokens, self.num_reqs = num_tokens, num_reqs
        self.basic_plan = self.cumulative_plan = None


def load_postmortem(path: str | Path) -> dict[str, Any]:
    """The parsed file; `PostmortemFileError` naming the path and what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PostmortemFileError(f"{path}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PostmortemFileError(f"{path}: not JSON (line {exc.lineno}: {exc.msg}); is it a post-mortem?") from None
    if not isinstance(document, dict) or POSTMORTEM_MARKER not in document:
        raise PostmortemFileError(f"{path}: not a graphcap post-mortem (its first key must be {POSTMORTEM_MARKER!r})")
    if document[POSTMORTEM_MARKER] != VERSION:
        raise PostmortemFileError(
            f"{path}: post-mortem format {document[POSTMORTEM_MARKER]!r}; this graphcap reads format {VERSION}"
        )
    for name, kind in (("error", dict), ("limits", dict), ("fields", list), ("steps", list)):
        if not isinstance(document.get(name), kind):
            raise PostmortemFileError(f"{path}: its {name!r} entry is missing or not a {kind.__name__}")
    return document


def recheck(document: dict[str, Any], path: str | Path = "the file") -> list[StepCheck]:
    """Every recorded step re-checked (see the module doc), oldest first."""
    try:
        limits = _limits_of(document["limits"])
        fields = {f["name"]: f for f in document["fields"]}
        return [StepCheck(i, step, *_check_step(step, fields, limits)) for i, step in enumerate(document["steps"])]
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        if isinstance(exc, InvariantViolation):
            raise
        raise PostmortemFileError(f"{path}: a malformed entry ({type(exc).__name__}: {exc})") from None


def _limits_of(raw: dict[str, Any]) -> _Limits:
    extras = tuple(
        _Extra(e["name"], e["rows"], e["row_dim"], float("nan") if e["pad"] == "nan" else e["pad"])
        for e in raw["extras"]
    )
    groups = tuple(
        _Group(g["name"], g["block_size"], g["num_blocks"], g["max_blocks_per_req"], g["sliding_window"])
        for g in raw["kv_groups"]
    )
    return _Limits(raw["block_size"], raw["max_blocks_per_req"], raw["num_blocks"], raw["vocab_size"],
                   raw["max_model_len"], PadRules(**raw["pad"]), extras, groups)  # fmt: skip


def _check_step(
    step: dict[str, Any], fields: dict[str, dict], limits: _Limits
) -> tuple[InvariantViolation | None, dict[str, np.ndarray]]:
    rows = np.frombuffer(base64.b64decode(step["rows"], validate=True), np.uint8)
    T, R = step["padded"]
    views = {}
    for name, start, nbytes in step["spans"]:
        field = fields[name]
        dtype = np.dtype(field["dtype"])
        shape = tuple(field["shape"])
        full = np.zeros(int(np.prod(shape)) * dtype.itemsize, np.uint8)
        full[:nbytes] = rows[start : start + nbytes]
        array = full.view(dtype).reshape(shape)
        counts = {"tokens": T, "reqs": R, "reqs+1": R + 1}
        if field["rows"] == "none":
            views[name] = array
        else:
            views[name] = array[(slice(None),) * field["row_dim"] + (slice(0, counts[field["rows"]]),)]
    axes = tuple(tuple(pair) for pair in step["key"]["axes"])
    key = GraphKey(step["key"]["num_tokens"], step["key"]["num_reqs"], step["key"]["uniform"], axes)
    n, r = step["num_tokens"], step["num_reqs"]
    staged = views.get(COUNTS_ENTRY)
    if staged is not None and (int(staged[0]), int(staged[1])) != (n, r):
        actual = f"[{int(staged[0])}, {int(staged[1])}]"
        why = "the staged counts are the step's"
        return InvariantViolation(COUNTS_ENTRY, None, f"[{n}, {r}]", actual, why, key), views
    host = SimpleNamespace(
        **{name: views[name] for name in FIELDS},
        extras=MappingProxyType({e.name: views[e.name] for e in limits.extras}),
        kv_groups=MappingProxyType(
            {
                g.name: _GroupRows(views[f"kv_groups.{g.name}.block_table"], views[f"kv_groups.{g.name}.slot_mapping"])
                for g in limits.kv_groups
            }
        ),
    )
    try:
        inputs = cast("ForwardInputs", _Inputs(host, key, limits, n, r))  # duck-typed: what the checks read
        check_invariants(inputs, "full", dummy=step["dummy"], kv_writes=step["kv_writes"])
    except InvariantViolation as violation:
        return violation, views
    return None, views
