"""One data-parallel rank of the multi-process tests: runs every scenario, writes its results.

The parent (`test_data_parallel.py`) spawns `run_rank` once per rank of a gloo world,
initialised from a file store under the test's tmp dir. Each rank captures, steps through
the scripted and random scenarios, then the capture-failure and timeout scenarios, and
pickles a plain dict to `rank{N}.pkl`: the parent asserts, so a failure names the scenario
and the rank. A rank that raises writes the traceback instead. Every rank leaves with
`os._exit`: after the timeout scenario a gloo worker thread is still blocked in the
abandoned all-reduce, and interpreter teardown would wait for it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

import graphcap
from graphcap.capture.verification import assert_close
from tests.configs import SMALL

CONFIG = {**SMALL, "model.num_layers": 1, "capture.on_error": "skip"}
MAX_SIZE = 16
MAX_NUM_SEQS = 8
VOCAB = 512
FAIL_SIZE_SKIP = 8  # the last rank's forward runs out of memory at this size (on_error: skip)
FAIL_SIZE_RAISE = 4  # rank 0's forward raises at this size (on_error: raise)
STICKY = "CUDA error: device-side assert triggered"  # the last rank's forward raises it at FAIL_SIZE_SKIP
NUM_RANDOM_STEPS = 12
TIMEOUT_S = 3.0  # Parallel.timeout of the timeout scenario
SLOW_S = 60.0  # Parallel.timeout and store timeout everywhere else: loaded CI machines are slow

Spec = tuple[int, ...] | None
"""A step of one rank: its query lengths, or None for an idle rank."""


def scripted_steps(rank: int, world_size: int) -> dict[str, Spec]:
    """This rank's batch in each scripted scenario (the parent holds the expected keys)."""
    last = rank == world_size - 1
    decode = (1,) * (3, 6, 2)[rank]  # 3, 6, 2 tokens: pad to 4, 8, 2
    return {
        "decode_sizes": decode,
        "one_mixed": (2, 1) if rank == 0 else decode,
        "above_max": (10, 10) if last else (1, 1, 1),
        "idle": None if rank == 0 else (1,) * 5 if rank == 1 else (3, 1),
        "all_idle": None,
        "idle_and_above_max": None if rank == 0 else (10, 10) if last else (1, 1),
        # the capture-failure manager: 5 tokens pad to the skipped size 8
        "skipped_size": (1,) * 5 if rank == 0 else (1, 1),
    }


def random_spec(step: int, rank: int) -> Spec:
    """A random step: idle, decode, mixed, or above capture.max_size."""
    rng = np.random.default_rng([step, rank])
    kind = rng.choice(4, p=[0.2, 0.35, 0.35, 0.1])
    if kind == 0:
        return None
    if kind == 1:
        return (1,) * int(rng.integers(1, MAX_NUM_SEQS + 1))
    if kind == 2:
        return tuple(int(q) for q in rng.integers(1, 5, int(rng.integers(1, 5))))
    return (9, 9)


def make_batch(spec: Spec, seed: int):
    """A `StepBatch` with random context, token ids and distinct KV blocks per request."""
    from graphcap import StepBatch

    if spec is None:
        return None
    rng = np.random.default_rng(seed)
    q = np.asarray(spec, dtype=np.int32)
    s = q + rng.integers(0, 40, len(q)).astype(np.int32)
    width = int(-(-s.max() // 16))
    table = np.arange(1, 1 + len(q) * width, dtype=np.int32).reshape(len(q), width)
    return StepBatch(q, s, rng.integers(0, VOCAB, int(q.sum())), table)


class FailingForward:
    """Wraps a model's forward; raises `error` when the staged key has `size` tokens."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.size: int | None = None
        self.error: BaseException | None = None

    def __call__(self, inputs):
        # Not in verification: its eager runs of larger keys' probe batches have this many tokens too, and
        # the failure stands for capturing this size.
        if self.size is not None and inputs.key.num_tokens == self.size and graphcap.phase() != "verify":
            raise self.error
        return self.forward(inputs)


def run_rank(rank: int, world_size: int, directory: str) -> None:
    """Spawn target: run every scenario on this rank, write `rank{rank}.pkl`, exit."""
    out = Path(directory)
    try:
        torch.set_num_threads(1)  # several ranks share two cores
        result = _scenarios(rank, world_size, out)
    except BaseException:
        result = {"error": traceback.format_exc()}
    try:
        tmp = out / f"rank{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, out / f"rank{rank}.pkl")
        if rank == world_size - 1 and "error" not in result:
            _wait_for_peers(out, world_size)  # the stopped rank stays alive until they timed out
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _scenarios(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from graphcap import CaptureError, CaptureManager, ConfigError, Parallel, load_config
    from graphcap.errors import DistributedTimeoutError
    from graphcap.models import build_model

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'store'}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=SLOW_S),
    )
    group = dist.group.WORLD
    result: dict[str, Any] = {"rank": rank}
    config = load_config(overrides=CONFIG)

    manager = CaptureManager(
        build_model(config), config, parallel=Parallel(dp_group=group, timeout=SLOW_S), progress=False
    )
    manager.capture()
    result["captured"] = sorted(manager.registry.captured)
    scripted = scripted_steps(rank, world_size)
    steps = {}
    for i, (name, spec) in enumerate(scripted.items()):
        if name != "skipped_size":
            steps[name] = _step(manager, spec, seed=1000 * i + rank)
    result["scripted"] = steps
    result["random"] = [
        _step(manager, random_spec(step, rank), seed=10_000 + 1000 * step + rank) for step in range(NUM_RANDOM_STEPS)
    ]
    result["stats"] = manager.stats.as_dict()

    # Capture failure on one rank under `skip`: every rank skips the key.
    model = build_model(config)
    failing = model.forward = FailingForward(model.forward)
    if rank == world_size - 1:
        failing.size, failing.error = FAIL_SIZE_SKIP, torch.OutOfMemoryError("injected: CUDA out of memory")
    skipper = CaptureManager(model, config, parallel=Parallel(dp_group=group, timeout=SLOW_S), progress=False)
    report = skipper.capture()
    failing.size = None
    result["skip"] = {
        "captured": sorted(skipper.registry.captured),
        "skipped": dict(skipper.registry.skipped),
        "report_skipped": [(r.key, r.reason) for r in report.skipped],
        "step": _step(skipper, scripted["skipped_size"], seed=99 + rank),
    }

    # The same failure under `raise` (rank 0 this time): every rank raises CaptureError.
    config_raise = load_config(overrides={**CONFIG, "capture.on_error": "raise"})
    model = build_model(config_raise)
    failing = model.forward = FailingForward(model.forward)
    if rank == 0:
        failing.size, failing.error = FAIL_SIZE_RAISE, RuntimeError("injected failure")
    raiser = CaptureManager(model, config_raise, parallel=Parallel(dp_group=group, timeout=SLOW_S), progress=False)
    try:
        raiser.capture()
        result["raise"] = None
    except CaptureError as exc:
        result["raise"] = {"type": type(exc).__name__, "message": str(exc), "num_graphs": len(raiser.graphs)}

    # A sticky CUDA error on the last rank under `skip`: every rank stops the pass (no rank waits
    # for the failed one in the next key's agreement).
    model = build_model(config)
    failing = model.forward = FailingForward(model.forward)
    if rank == world_size - 1:
        failing.size, failing.error = FAIL_SIZE_SKIP, RuntimeError(STICKY)
    stopper = CaptureManager(model, config, parallel=Parallel(dp_group=group, timeout=SLOW_S), progress=False)
    try:
        stopper.capture()
        result["sticky"] = None
    except CaptureError as exc:
        result["sticky"] = {"message": str(exc), "num_graphs": len(stopper.graphs)}

    # Different configs: every rank refuses at construction, naming each key that differs.
    mismatched = load_config(overrides={**CONFIG, "capture.max_size": 8 if rank == 0 else 16})
    try:
        CaptureManager(
            build_model(mismatched), mismatched, parallel=Parallel(dp_group=group, timeout=SLOW_S), progress=False
        )
        result["mismatch"] = None
    except ConfigError as exc:
        result["mismatch"] = {"keys": [p.key for p in exc.problems], "message": str(exc)}
    # Keys that are per rank by nature (device, report.path) may differ.
    own = load_config(overrides={**CONFIG, "report.path": str(out / f"report{rank}.json")})
    CaptureManager(build_model(own), own, parallel=Parallel(dp_group=group, timeout=SLOW_S), progress=False)
    result["per_rank_keys_agree"] = True

    # The last rank stops stepping: the others get DistributedTimeoutError, not a hang.
    dist.barrier()
    # Every rank builds the manager (construction agrees on the config: a collective) ...
    stuck = CaptureManager(
        build_model(config), config, parallel=Parallel(dp_group=group, timeout=TIMEOUT_S), progress=False
    )
    if rank != world_size - 1:  # ... and the last one never steps
        start = time.perf_counter()
        try:
            stuck.execute(make_batch((1, 1), seed=rank))
            result["timeout"] = None
        except DistributedTimeoutError as exc:
            result["timeout"] = {"message": str(exc), "seconds": time.perf_counter() - start}
    return result


def _step(manager, spec: Spec, seed: int) -> dict[str, Any]:
    """Dispatch, execute and compare with eager; what ran, why, and whether it matched."""
    from graphcap import StepBatch

    batch = make_batch(spec, seed)
    key = manager.dispatch(batch)
    hits, eager = Counter(manager.stats.graph_hits), Counter(manager.stats.eager)
    output = manager.execute(batch).clone()
    ran = [k for k, n in manager.stats.graph_hits.items() if n != hits[k]]
    reasons = [r for r, n in manager.stats.eager.items() if n != eager[r]]
    reference = manager.eager(batch if batch is not None else StepBatch([], []))
    try:
        assert_close(output, reference)
        match = "ok"
    except AssertionError as exc:
        match = str(exc)
    return {
        "spec": spec,
        "key": key,
        "ran": ran[0] if ran else None,
        "reason": reasons[0] if reasons else "",
        "rows": output.shape[0],
        "match": match,
    }


def _wait_for_peers(out: Path, world_size: int) -> None:
    deadline = time.monotonic() + SLOW_S
    while time.monotonic() < deadline:
        if all((out / f"rank{r}.pkl").exists() for r in range(world_size - 1)):
            return
        time.sleep(0.05)
