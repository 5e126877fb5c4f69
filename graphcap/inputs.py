"""The types a model's forward sees: `ForwardInputs`, its host mirror, and the staging bounds.

`PersistentBuffers.stage` (buffers.py) makes them; `check_invariants` and models read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from graphcap.batch import GraphKey
from graphcap.config import PadRules

__all__ = ["FIELDS", "ForwardInputs", "HostView", "StagingLimits"]

FIELDS = ("query_start_loc", "seq_lens", "input_ids", "positions", "slot_mapping", "block_table")
"""The static input tensors of every graph, in their packed-buffer order."""


class HostView(NamedTuple):
    """Numpy views of the staged rows on the host (the rows `ForwardInputs` exposes)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R+1]
    seq_lens: np.ndarray  # [R]
    block_table: np.ndarray  # [R, B]


@dataclass(frozen=True, slots=True)
class StagingLimits:
    """Bounds the staged values must respect (None: unknown, not checked)."""

    block_size: int
    max_blocks_per_req: int
    num_blocks: int | None
    vocab_size: int | None
    max_model_len: int | None
    pad: PadRules

    @property
    def num_slots(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size


@dataclass(slots=True)
class ForwardInputs:
    """What `model.forward` receives: views of the persistent tensors for one key.

    Tensor rows cover the padded shape (`T = key.num_tokens`, `R = key.num_reqs`); only the
    first `num_tokens` tokens and `num_reqs` requests are real. The views alias persistent
    storage: they stay valid, and keep their addresses, for the life of the buffers, and the
    next `stage` overwrites them. A model must not resize or replace them.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32, PAD_SLOT_ID for tokens that must not write the cache
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [R] int32, total lengths including this step
    block_table: torch.Tensor  # [R, max_blocks_per_req] int32
    num_tokens: int
    num_reqs: int
    key: GraphKey
    host: HostView
    limits: StagingLimits

    def tensors(self) -> dict[str, torch.Tensor]:
        """The static input tensors by name (what a graph records addresses of)."""
        return {name: getattr(self, name) for name in FIELDS}
