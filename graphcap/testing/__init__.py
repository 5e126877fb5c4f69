"""Test helpers engines can use on their own model and pad rules (the `torch.testing` idea).

| module | holds |
|---|---|
| `faults.py` | `FaultyModel` (fails on demand), snapshots, hostile batches |
| `fuzz.py` | the batch fuzzer and its independent validity oracle |
| `stress.py` | the poisoned stress loop (graph == eager on every real row) |
| `threads.py` | several threads on one manager, and the interleaving detector |
| `traffic.py` | traffic shapes and their histograms, for choosing sizes (not imported here) |
| `allocations.py` | the exact allocation peak of a capture, from the profiler (not imported here) |
| `ranks.py` | `rank_context()`: ranks of a multi-rank run forked from a preloaded server (not imported here) |

`Workload`, `fill_batch` (`graphcap.workload`) and `time_key` (`graphcap.capture.timing`) are product
code that the command line uses; they are re-exported here for the tests and `tools/`.

`TINY` is the small configuration the test suite and the reliability campaign share, and
`make_config` / `make_manager` build on it. Importing this package imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from graphcap.capture.timing import KeyTiming, time_key
from graphcap.capture.verification import assert_close
from graphcap.config import CaptureConfig, load_config
from graphcap.manager import CaptureManager
from graphcap.models import build_model
from graphcap.testing.faults import (
    FAULTS,
    MOVES,
    PHASES,
    FaultyModel,
    Hostile,
    Move,
    Snapshot,
    Wrapped,
    assert_nothing_left,
    assert_unchanged,
    hostile_batches,
    kv_cache,
    leftover_temp_files,
    remember_freeze_count,
    snapshot,
)
from graphcap.testing.fuzz import (
    BAD_FORMS,
    INT_FORMS,
    REFUSALS,
    BatchPlan,
    Limits,
    assert_config_works,
    check_plan,
    random_plan,
    violations,
)
from graphcap.testing.stress import StressResult, stress
from graphcap.testing.threads import (
    NUM_THREADS,
    STEPS_PER_THREAD,
    EventLog,
    NoLock,
    expected_outputs,
    run_threads,
    thread_batches,
)
from graphcap.workload import Request, Workload, fill_batch

__all__ = [
    "assert_close",
    "BAD_FORMS",
    "FAULTS",
    "FAULT_SIZES",
    "INT_FORMS",
    "MOVES",
    "NUM_THREADS",
    "PHASES",
    "REFUSALS",
    "STEPS_PER_THREAD",
    "TINY",
    "BatchPlan",
    "EventLog",
    "FaultyModel",
    "Hostile",
    "KeyTiming",
    "Limits",
    "Move",
    "NoLock",
    "Request",
    "Snapshot",
    "StressResult",
    "Workload",
    "assert_config_works",
    "assert_nothing_left",
    "assert_unchanged",
    "check_plan",
    "expected_outputs",
    "fill_batch",
    "hostile_batches",
    "kv_cache",
    "leftover_temp_files",
    "make_config",
    "make_manager",
    "nested",
    "random_plan",
    "remember_freeze_count",
    "run_threads",
    "snapshot",
    "stress",
    "thread_batches",
    "time_key",
    "violations",
    "Wrapped",
]

TINY: dict[str, Any] = {
    "device": "cpu",
    "model.hidden_size": 32,
    "model.num_layers": 1,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "model.vocab_size": 128,
    "batching.max_num_seqs": 8,
    "batching.max_num_tokens": 32,
    "kv_cache.block_size": 4,
    "kv_cache.num_blocks": 72,
    "kv_cache.max_model_len": 32,
    "capture.sizes": [2, 4, 8],
    "capture.num_warmups": 1,
    "checks.invariants": "full",
    "checks.verify_replay": True,
}
"""A 1-layer, 32-wide model over a cache of 4-token blocks, as dotted overrides: small enough
that capturing its keys takes well under a second on one CPU thread, big enough for padded
tails, block crossings and eager fallbacks (steps above the largest size). 72 blocks hold 8
requests of max_model_len, so a stress workload never starves for blocks."""

FAULT_SIZES = {"capture.sizes": [2, 4]}
"""Four keys (uniform and mixed at 4 then 2 tokens, the capture order), for fault injection."""


def nested(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted overrides (`{"capture.max_size": 4}`) as a nested YAML document."""
    doc: dict[str, Any] = {}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if key:
            doc.setdefault(section, {})[key] = value
        else:
            doc[section] = value
    return doc


def make_config(overrides: Mapping[str, Any] | None = None, /, **kwargs: Any) -> CaptureConfig:
    """TINY plus dotted `overrides`, plus keyword overrides with `__` for the dot."""
    extra = {k.replace("__", "."): v for k, v in kwargs.items()}
    return load_config(overrides={**TINY, **(overrides or {}), **extra})


def make_manager(
    config: CaptureConfig, *, faulty: bool = False, threads: int | None = None, **kwargs: Any
) -> CaptureManager:
    """A manager over the reference model (wrapped in `FaultyModel` when `faulty`). `threads`: torch's CPU threads
    for the whole process, set first when given (None: torch's setting is left alone)."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = build_model(config)
    kwargs.setdefault("progress", False)
    if faulty:  # the reference model (TINY): an nn.Module
        return remember_freeze_count(CaptureManager(FaultyModel(cast(torch.nn.Module, model)), config, **kwargs))
    return remember_freeze_count(CaptureManager(model, config, **kwargs))
