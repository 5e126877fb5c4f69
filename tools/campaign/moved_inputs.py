"""Static inputs moved after capture and real replays, and forwards that freeze a host value
into the graph.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from graphcap import CaptureError, StaticInputMovedError, StepBatch
from graphcap.capture.verification import assert_close
from graphcap.testing import MOVES, make_config, make_manager

from .trials import Row, Scale, Tally

LEVELS = ("off", "basic", "full")
PROBE_STEP = StepBatch([1, 1], [3, 4], [5, 6], [[1], [2]])


def _frozen_forward(inner: Callable, read: Callable | None) -> Callable:
    """The reference model made wrong in one of the ways a graph freezes a host value."""

    def forward(inputs):
        out = inner(inputs)
        if read is None:  # a reduction over rows sliced by a Python count
            return out + out[: inputs.num_tokens].sum(0)
        return out * read(inputs)

    return forward


def moved_rows(scale: Scale) -> list[Row]:
    refused, unchecked = Tally(), Tally()
    trials = [(move, level) for level in LEVELS for move in MOVES]
    if not scale.every_move_at_every_level:
        trials = [(move, LEVELS[i % len(LEVELS)]) for i, move in enumerate(MOVES)]
    for move, level in trials:
        with refused.trial(f"{move.name} at {level}"):
            manager = make_manager(make_config(checks__invariants=level))
            manager.register_static("extra", torch.zeros(8))
            manager.capture()
            for _ in range(scale.faults):  # real replays first: the check is not a first-replay one
                manager.execute(PROBE_STEP)
            move.apply(manager)
            for _ in range(2):  # refused until capture() runs again
                try:
                    manager.execute(PROBE_STEP)
                except StaticInputMovedError as exc:
                    if not re.search(move.match, str(exc)):
                        raise AssertionError(f"message does not match {move.match!r}: {exc}") from None
                else:
                    raise AssertionError("replayed after the move")
            manager.capture()
            assert_close(manager.execute(PROBE_STEP).clone(), manager.eager(PROBE_STEP))
    rows = [
        refused.row(
            "moved inputs",
            f"a static tensor moved after capture and real replays ({len(MOVES)} ways) x invariants off/basic/full"
            + ("" if scale.every_move_at_every_level else " (quick: each way at one level, the levels in turn)"),
            "every later replay refused with StaticInputMovedError naming it, until capture() again",
        )
    ]
    frozen = {
        "scaled by inputs.num_tokens": lambda inputs: inputs.num_tokens,
        "scaled by a host seq_lens value": lambda inputs: float(inputs.host.seq_lens[: inputs.num_reqs].max()),
        "scaled by a host token id": lambda inputs: int(inputs.host.input_ids[0]) + 1,
        "sums rows [:inputs.num_tokens]": None,
    }
    for name, read in frozen.items():
        with unchecked.trial(name):
            config = make_config(capture__sizes=[4, 8])
            manager = make_manager(config)
            manager._forward = _frozen_forward(manager.model, read)
            try:
                manager.capture()
            except CaptureError as exc:
                if "partly filled" not in str(exc):
                    raise AssertionError(f"refused for another reason: {exc}") from None
            else:
                raise AssertionError("captured")
    rows.append(
        unchecked.row(
            "verification",
            "forwards that freeze a host value into the graph (a Python count, host metadata, a slice)",
            "capture refused: replay of the partly filled second batch differs from eager",
        )
    )
    return rows
