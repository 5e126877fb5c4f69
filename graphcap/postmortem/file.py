"""The post-mortem file: what the flight recorder held when an error left a step, as JSON.

`write_postmortem` runs when an exception leaves `execute`, `capture` or `capture_pending` (not an
`InvariantViolation`, `BatchError` or `ConfigError`: those name the field already). It writes the
recorder's steps to `report.postmortem` (a `.json` path, or a directory: `graphcap-postmortem.json`
in it; default the working directory; with data- or tensor-parallel peers each rank its own
`NAME.rankN.json`), under the rules of reports: atomically, and never over a file graphcap did not
write (its first key is `POSTMORTEM_MARKER`). Then it names the file on the error (`add_note`, and the
attribute `graphcap_postmortem`); the error itself is re-raised unchanged by the caller. A write that
fails names why instead: it never replaces the original error.

The format (version 1), readable without torch: the marker and version, `error` (type, message, the
call, the failing phase), `rank` and `world_size` (null without peers), `invariants` (the level the
steps ran under), `limits` (the bounds and pad rules the checks use), `fields` (the packed layout:
name, dtype, full shape, rows, row_dim) and `steps`, oldest first, each with its key, mode, eager
reason, phase, real counts, padded shape and its rows as base64 (`spans`: where each field lies).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from graphcap.errors import BatchError, ConfigError, InvariantViolation
from graphcap.phases import failed_in
from graphcap.report_files import atomic_write, may_overwrite

__all__ = [
    "DEFAULT_NAME",
    "EXCEPTED",
    "POSTMORTEM_MARKER",
    "VERSION",
    "environment_rank",
    "failing_phase",
    "postmortem_path",
    "write_postmortem",
]

log = logging.getLogger("graphcap")

POSTMORTEM_MARKER = "graphcap_postmortem"
"""The first key of every post-mortem file (its value: the format version)."""
VERSION = 1
DEFAULT_NAME = "graphcap-postmortem.json"
EXCEPTED = (InvariantViolation, BatchError, ConfigError)
"""Errors that write no post-mortem: each names the field, value and fix itself."""


def postmortem_path(setting: str | None, rank: int | None) -> Path:
    """Where the post-mortem goes: `setting` a `.json` path or a directory (None: the working directory);
    with peers (`rank` given) the rank is in the name (`graphcap-postmortem.rank1.json`)."""
    if setting is None:
        path = Path.cwd() / DEFAULT_NAME
    elif setting.endswith(".json"):
        path = Path(setting)
    else:
        path = Path(setting) / DEFAULT_NAME
    if rank is not None:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    return path


def failing_phase(exc: BaseException, call_phase: str) -> str:
    """The innermost graphcap phase the error (or the error it was raised from) left; else the call's phase."""
    seen = exc
    for _ in range(8):  # a CaptureError raised from the forward's error carries the forward's phase
        where = failed_in(seen)
        if where is not None:
            return where
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            break
        seen = nxt
    return call_phase


def write_postmortem(
    exc: BaseException,
    call: str,
    call_phase: str,
    steps: Iterable[Any],
    *,
    setting: str | None,
    fields: Iterable[Any],
    limits: Any,
    invariants: str,
    rank: int | None = None,
    world_size: int | None = None,
    num_recorded: int = 0,
) -> Path | None:
    """Write the post-mortem of `exc` leaving `call` and name it on `exc`; the path, or None when none was
    written (the note then says why). Never raises (but for `KeyboardInterrupt`)."""
    path = postmortem_path(setting, rank)
    try:
        if not may_overwrite(path, POSTMORTEM_MARKER):
            raise FileExistsError(
                f"{path} exists and is not a graphcap post-mortem (graphcap overwrites only files that start with "
                f"its {POSTMORTEM_MARKER!r} key, or empty ones): set report.postmortem to another path"
            )
        where = failing_phase(exc, call_phase)
        document = {
            POSTMORTEM_MARKER: VERSION,
            "error": {"type": type(exc).__name__, "message": str(exc)[:4000], "call": call, "phase": where},
            "rank": rank,
            "world_size": world_size,
            "invariants": invariants,
            "num_recorded": num_recorded,
            "limits": _limits(limits),
            "fields": [
                {"name": e.name, "dtype": e.dtype.str, "shape": list(e.shape), "rows": e.rows, "row_dim": e.row_dim}
                for e in fields
            ],
            "steps": [_step(s) for s in steps],
        }
        atomic_write(path, json.dumps(document, indent=1) + "\n")
    except Exception as failure:  # the original error is what matters: say why, never replace it
        _note(exc, f"graphcap: the post-mortem could not be written to {path}: {type(failure).__name__}: {failure}")
        return None
    count = len(cast("list[Any]", document["steps"]))
    _note(exc, f"graphcap: post-mortem of the last {count} staged steps in {path} (run: graphcap inspect {path})")
    with contextlib.suppress(AttributeError, TypeError):  # the path, also where notes do not exist (3.10)
        exc.graphcap_postmortem = str(path)  # type: ignore[attr-defined]
    return path


def _note(exc: BaseException, text: str) -> None:
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(text)
    else:  # Python 3.10: no notes; the log carries it
        log.error("%s", text)


def _step(step: Any) -> dict[str, Any]:
    key = step.key
    return {
        "step": step.step,
        "key": {
            "num_tokens": key.num_tokens,
            "num_reqs": key.num_reqs,
            "uniform": key.uniform,
            "axes": [list(pair) for pair in key.axes],
        },
        "key_text": str(key),
        "mode": step.mode,
        "reason": step.reason,
        "phase": step.phase,
        "num_tokens": step.num_tokens,
        "num_reqs": step.num_reqs,
        "padded": list(step.shape),
        "dummy": step.dummy,
        "kv_writes": step.kv_writes,
        "spans": [[span.name, span.start, span.nbytes] for span in step.spans],
        "rows": base64.b64encode(step.rows.tobytes()).decode("ascii"),
    }


def _limits(limits: Any) -> dict[str, Any]:
    pad = limits.pad
    return {
        "block_size": limits.block_size,
        "max_blocks_per_req": limits.max_blocks_per_req,
        "num_blocks": limits.num_blocks,
        "vocab_size": limits.vocab_size,
        "max_model_len": limits.max_model_len,
        "pad": {
            name: getattr(pad, name) for name in ("query_len", "seq_len", "slot", "position", "token_id", "block_id")
        },
        "extras": [
            {
                "name": s.name,
                "rows": s.rows,
                "row_dim": s.row_dim,
                "pad": _plain(s.pad),
                "has_check": s.check is not None,
            }
            for s in limits.extras
        ],
        "kv_groups": [
            {
                "name": g.name,
                "block_size": g.block_size,
                "num_blocks": g.num_blocks,
                "max_blocks_per_req": g.max_blocks_per_req,
                "sliding_window": g.sliding_window,
            }
            for g in limits.kv_groups
        ],
    }


def _plain(value: Any) -> Any:
    """A pad value JSON holds exactly (a float NaN pad as the string "nan")."""
    if isinstance(value, float) and value != value:
        return "nan"
    return value.item() if hasattr(value, "item") else value


def environment_rank(peers: Any) -> tuple[int | None, int | None]:
    """(rank, world size) of a manager's peers, (None, None) without."""
    if peers is None:
        return None, None
    sizes = [sync.world_size for sync in getattr(peers, "syncs", ())]
    world = 1
    for size in sizes:
        world *= size
    return peers.rank, world
