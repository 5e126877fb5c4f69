"""Agreement with data- and tensor-parallel peers: `StepAgreement` (a step), `GroupSync` (one reduction).

`options.Parallel` is what an engine passes (`CaptureManager(..., parallel=Parallel(...))`).

`groups` makes the CPU group an agreement runs on; `sync` is the one reduction, carrying the
step and the call; `step` orders a step so no rank strands its peers; `agreed` is what a rank
runs in an agreed step. docs/guide/distributed.md is the
user's view.
"""

from graphcap.distributed.options import Parallel
from graphcap.distributed.step import (
    COUNTS_BUFFER,
    AgreedStep,
    StepAgreement,
    counts_buffers,
    is_collective_error,
)
from graphcap.distributed.sync import Agreement, GroupSync

__all__ = [
    "COUNTS_BUFFER",
    "AgreedStep",
    "Agreement",
    "GroupSync",
    "Parallel",
    "StepAgreement",
    "counts_buffers",
    "is_collective_error",
]
