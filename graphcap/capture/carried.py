"""Carried state: what a forward keeps between runs, named when verification finds a replay and an eager run apart.

A forward that writes state a later run reads (a running sum, a per-row cache outside the
KV cache, rows a padded request updates that a real request later reads) gives another
result each time it runs the same batch, so no replay can match an eager run of it. Blaming a
frozen host value or missing scratch blocks then sends its author the wrong way:
`carried_state` runs the batch once more eagerly and once more replayed, and when either
differs from its first run, names the tensors (and their rows) the eager run changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["carried_state", "row_fingerprints"]

_CHUNK = 1 << 20
"""Elements a fingerprint reduces at once: its float64 temporaries stay bounded whatever a tensor's size."""


def row_fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per tensor, a `[rows, 2]` float64 summary of each row along dim 0 (its sum and its sum of squares).

    Cheap next to a copy (a KV cache of gigabytes leaves a few kilobytes), and a write of other
    values changes it in all but contrived cases. A 0-dim tensor is one row.
    """
    out = {}
    with torch.no_grad():
        for name, tensor in tensors.items():
            flat = tensor.reshape(1, -1) if tensor.dim() == 0 else tensor.reshape(tensor.shape[0], -1)
            rows = flat.shape[0]
            summary = torch.zeros(rows, 2, dtype=torch.float64, device=tensor.device)
            step = max(1, _CHUNK // max(1, flat.shape[1]))
            for start in range(0, rows, step):
                part = flat[start : start + step].to(torch.float64)
                summary[start : start + step, 0] = part.sum(1)
                summary[start : start + step, 1] = part.square().sum(1)
            out[name] = summary.cpu()
    return out


def carried_state(
    state: Mapping[str, torch.Tensor],
    *,
    eager_again: Callable[[], Any],
    replay_again: Callable[[], Any],
    differ: Callable[[Any, Any], bool],
    first: tuple[Any, Any],
    batch: str,
) -> str | None:
    """Why a replay and an eager run of the same batch differ when the forward carries state; None when it does not.

    `state`: the tensors the forward may write that are not staged inputs (the model's buffers, registered
    statics, KV caches). `first`: the first replay's and eager run's real rows. Runs `eager_again()` and
    `replay_again()` (each returns real rows), and when one differs from its first run (`differ`), returns
    the message naming the tensors the eager run changed (None when eager runs differ and none did: the
    result changes with a Python value or randomness, not with state graphcap sees); `batch` describes
    the batch.
    """
    replayed, expected = first
    before = row_fingerprints(state)
    eager_differs = differ(eager_again(), expected)
    # What an eager run of a batch that just ran changes is state: a sink that replays and eager runs
    # write differently (padded tokens, or verification's real tokens without scratch blocks) is not.
    after = row_fingerprints(state)
    replay_differs = differ(replay_again(), replayed)
    if not (eager_differs or replay_differs):
        return None
    changed = []
    for name, old in before.items():
        # Beyond rounding: a replay at the padded shape and an eager run write the same rows a few ulps apart.
        rows = (~torch.isclose(old, after[name], rtol=1e-4, atol=1e-6)).any(1).nonzero().flatten().tolist()
        if rows:
            changed.append(f"{name} (rows {_ranges(rows)})" if len(old) > 1 else name)
    if not changed and eager_differs:  # a Python value changed per call, randomness: the caller's message says so
        return None
    runs = "two eager runs" if eager_differs else "two replays"
    what = (
        f"an eager run of it changed {', '.join(changed)}" if changed else "the replay reads state an earlier run wrote"
    )
    return (
        f"the forward carries state between runs: {runs} of the same batch ({batch}) differ, so a replay cannot "
        f"match an eager run; {what}. Padded rows run in every replay and in no eager run: state they write is "
        "read by later runs. Keep padded rows from writing state a later run reads (mask them with "
        "inputs.padding_mask(), or give them a sink row) and let no real row read state an earlier step's padded "
        "rows wrote."
    )


def _ranges(rows: list[int]) -> str:
    """`[0, 1, 2, 5]` as `0-2, 5` (at most six ranges, then how many more)."""
    spans: list[list[int]] = []
    for row in rows:
        if spans and row == spans[-1][1] + 1:
            spans[-1][1] = row
        else:
            spans.append([row, row])
    words = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:6]]
    return ", ".join(words) + (f" and {len(spans) - 6} more" if len(spans) > 6 else "")
