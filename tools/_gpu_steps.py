"""gpu_check cases that capture and step: the tiny config, pipelined real batches,
the cross-graph output probe, piecewise capture and the data-parallel agreement (the 8B-shaped
model: `_gpu_llama`). Each case is `(device, quick) -> dict` with `ok` (as predicted), `observed`
(one line) and its numbers."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from graphcap import CaptureManager, StepBatch, load_config
from graphcap.batch import dummy_batch
from graphcap.capture.verification import assert_close
from graphcap.config import CaptureConfig
from graphcap.keys import GraphKey
from graphcap.models import build_model
from graphcap.testing import fill_batch, time_key

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(device: str, quick: bool, **overrides) -> CaptureConfig:
    """The embedded default config (tiny reference model) on `device`; checks at `basic` so that
    timed replays do not pay a full address sweep (eager steps do not)."""
    base = {"device": device, "checks.invariants": "basic", "checks.sync_debug": device.startswith("cuda")}
    if quick:
        base["capture.max_size"] = 8
    return load_config(None, {**base, **overrides})


def _manager(config: CaptureConfig) -> CaptureManager:
    """A captured manager; `on_error: raise` (the default) means every key is also verified."""
    manager = CaptureManager(build_model(config), config, progress=False)
    manager.capture()
    return manager


def tiny(device: str, quick: bool) -> dict:
    config = tiny_config(device, quick)
    manager = _manager(config)
    rows = []
    for key in manager.graphs:
        timing = time_key(manager, key, steps=2 if quick else 20, warmup=1 if quick else 3)
        if timing is not None:
            rows.append(
                {"key": str(key), "eager_ms": timing.eager_ms, "replay_ms": timing.replay_ms, "speedup": timing.speedup}
            )
    rows.sort(key=lambda r: r["key"])
    planned = len(manager.registry.planned)
    captured = len(manager.graphs)
    speed = {r["key"]: round(r["speedup"], 2) for r in rows}
    observed = f"{captured} of {planned} keys captured and verified; replay speedup per key {speed}"
    return {"ok": captured == planned, "observed": observed, "timings": rows}


def unique_batch(key: GraphKey, config: CaptureConfig, rng: np.random.Generator) -> StepBatch:
    """A real batch that fills `key` whose requests own distinct KV blocks (no two write one slot,
    so graph and eager must agree exactly up to kernel tiling)."""
    kv = config.kv_cache
    q = dummy_batch(key, max_model_len=kv.max_model_len).query_lens.astype(np.int64)
    blocks_each = (kv.num_blocks - 1) // max(1, len(q))
    longest = np.minimum(kv.max_model_len, blocks_each * kv.block_size)
    context = rng.integers(0, np.maximum(1, longest - q + 1))
    seq = q + context
    need = -(-seq // kv.block_size)
    free = rng.permutation(np.arange(1, kv.num_blocks))
    table = np.zeros((len(q), kv.max_blocks_per_req), dtype=np.int64)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = free[start : start + n]
        start += n
    ids = rng.integers(0, config.model.vocab_size, int(q.sum()))
    return StepBatch(q, seq, ids, table)


def pipelined(device: str, quick: bool) -> dict:
    config = tiny_config(device, quick)
    manager = _manager(config)
    model, keys = manager.model, sorted(manager.graphs, key=str)
    rng = np.random.default_rng(0)
    busy = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device) if device.startswith("cuda") else None
    outputs, references = [], []
    steps = 30 if quick else 300
    for _ in range(steps):
        batch = unique_batch(keys[rng.integers(len(keys))], config, rng)
        if busy is not None:
            busy @ busy  # queued GPU work: the next upload lags behind the host
        model.reset_kv_cache()
        outputs.append(manager.execute(batch).clone())
        model.reset_kv_cache()
        references.append(manager.eager(batch).clone())
    manager.backend.synchronize()
    mismatches, worst = 0, 0.0
    for out, ref in zip(outputs, references):
        worst = max(worst, float((out - ref).abs().max()))
        try:
            assert_close(out, ref, **config.checks.tolerance)
        except AssertionError:
            mismatches += 1
    hits = sum(manager.stats.graph_hits.values())
    observed = f"{steps} steps ({hits} replays), {mismatches} differ from eager (max |diff| {worst:.2e})"
    return {"ok": mismatches == 0 and hits > 0, "observed": observed, "mismatches": mismatches, "max_abs_diff": worst}


def clobber(device: str, quick: bool) -> dict:
    """Keep a step's output view (no clone), run another step, see whether the view changed."""
    config = tiny_config(device, quick)
    first, second = _manager(config), _manager(config)
    order = [k for k in first.registry.capture_order() if k in first.graphs]
    small, large = order[-1], order[0]  # captured last (carved from freed memory), captured first
    small_batch, large_batch = fill_batch(small, config, 1), fill_batch(large, config, 2)

    def kept_after(other: CaptureManager) -> bool:
        kept = first.execute(small_batch)
        copy = kept.clone()
        other.execute(large_batch)
        first.backend.synchronize()
        return torch.equal(kept, copy)

    same_pool_intact = kept_after(first)
    other_manager_intact = kept_after(second)
    observed = (
        f"one pool ({small} kept, {large} replayed): view {'intact' if same_pool_intact else 'changed'}; "
        f"another manager's step: view {'intact' if other_manager_intact else 'changed'}"
    )
    return {"ok": other_manager_intact, "observed": observed, "same_pool_intact": same_pool_intact}


def piecewise(device: str, quick: bool) -> dict:
    """full_and_piecewise with the per-request attention (`.item()` lengths, never graph-safe):
    capture, then a chunked-prefill + decode stream compared with eager step by step, and the
    replay time of pieces, full graphs and eager at each size."""
    from graphcap.testing import Workload

    config = tiny_config(device, quick, **{"capture.mode": "full_and_piecewise", "model.attention": "per_request"})
    manager = _manager(config)
    pieces = {str(k): manager.graphs[k].num_pieces for k in manager.graphs if k.piecewise}
    workload = Workload(config, seed=0, chunk=7)
    rng = np.random.default_rng(0)
    largest = manager.registry.sizes.max_size
    mismatches, worst, below_max_eager, steps = 0, 0.0, 0, 0
    for _ in range(40 if quick else 200):
        while len(workload.running) < 6:
            workload.add_random(48)
        batch = workload.next_batch(max_tokens=int(rng.integers(1, largest + 2)))
        replayed = manager.execute(batch).clone()
        below_max_eager += batch.num_tokens <= largest and manager.last_key not in manager.graphs
        expected = manager.eager(batch)
        worst = max(worst, float((replayed - expected).abs().max()))
        try:
            assert_close(replayed, expected, **config.checks.tolerance)
        except AssertionError:
            mismatches += 1
        workload.advance(expected)
        steps += 1
    timings = {}
    for key in sorted(manager.graphs, key=lambda k: (k.num_tokens, k.piecewise)):
        timing = time_key(manager, key, steps=2 if quick else 20, warmup=1 if quick else 3)
        if timing is not None:
            timings[str(key)] = {"eager_ms": timing.eager_ms, "replay_ms": timing.replay_ms}
    stats = manager.stats
    observed = (
        f"{len(manager.graphs)} of {len(manager.registry.planned)} keys captured and verified ({pieces}); "
        f"{steps} steps: {stats.piecewise_replays} piecewise replays, "
        f"{sum(stats.graph_hits.values()) - stats.piecewise_replays} full, {sum(stats.eager.values())} eager "
        f"({below_max_eager} at or below the max size); {mismatches} differ from eager (max |diff| {worst:.2e})"
    )
    ok = len(manager.graphs) == len(manager.registry.planned) and mismatches == 0 and below_max_eager == 0
    return {"ok": ok, "observed": observed, "pieces": pieces, "timings": timings, "stats": stats.as_dict()}


def agreement(device: str, quick: bool) -> dict:
    """Per-step cost of the agreement: `dispatch` (the collective and the key lookup, no forward)
    and `execute` (the whole step, no sync between steps), with and without a group."""
    import numpy as np
    import torch.distributed as dist

    on_cuda = device.startswith("cuda")
    steps = 20 if quick else 300
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=store, rank=0, world_size=1)
        try:
            config = tiny_config(device, True, **{"capture.mode": "full_decode_only"})
            model = build_model(config)
            world = f"world group ({dist.get_backend()})"
            groups = {"no group": None, world: dist.group.WORLD, "gloo subgroup": dist.new_group(backend="gloo")}
            dispatch_ms, execute_ms, agreement_backend, old_ms = {}, {}, None, None
            for label, group in groups.items():
                manager = CaptureManager(model, config, group=group, progress=False)
                manager.capture()
                batch = unique_batch(manager.registry.capture_order()[0], config, np.random.default_rng(0))
                if group is dist.group.WORLD:
                    agreement_backend = manager._peers.dp.group.name()  # private: what the tool checks
                dispatch_ms[label] = _step_ms(manager, manager.dispatch, batch, steps * 4)
                execute_ms[label] = _step_ms(manager, manager.execute, batch, steps)
            if on_cuda:  # the agreement as it was: a pageable upload, an NCCL all-reduce, a host read
                old_ms = _step_ms(manager, lambda batch: _nccl_agreement(device), None, steps)
        finally:
            dist.destroy_process_group()
    overhead = {k: round(v - dispatch_ms["no group"], 4) for k, v in dispatch_ms.items() if k != "no group"}
    observed = f"agreement on {agreement_backend}; dispatch overhead ms per step {overhead}; execute ms {execute_ms}"
    if old_ms is not None:
        observed += f"; the old agreement alone (upload, NCCL all-reduce, host read): {old_ms} ms"
    # The < 1 ms goal is judged on a GPU machine; on the CPU (the test suite's quick run, a loaded machine)
    # the figures are printed and only the agreement's backend decides.
    ok = agreement_backend == "gloo" and (not on_cuda or max(overhead.values()) < 1.0)
    result = {"dispatch_ms": dispatch_ms, "execute_ms": execute_ms, "old_nccl_ms": old_ms}
    return {"ok": ok, "observed": observed, **result}


def _nccl_agreement(device: str) -> list[int]:
    import torch.distributed as dist

    values = torch.tensor([8, 0, 0, 8], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def _step_ms(manager: CaptureManager, step, batch, steps: int) -> float:
    """Median host ms per call over blocks of 10, with no sync between calls (a pipelined engine)."""
    for _ in range(5):
        step(batch)
    manager.backend.synchronize()
    samples = []
    for _ in range(max(1, steps // 10)):
        start = time.perf_counter()
        for _ in range(10):
            step(batch)
        samples.append((time.perf_counter() - start) * 100)  # ms per call
    manager.backend.synchronize()
    return round(statistics.median(samples), 4)


def lazy_budget(device: str, quick: bool) -> dict:
    """`capture.strategy: lazy` within `capture.memory_budget`: a step served before any capture, the budget
    reserved in the graph pool by `capture()`, every key captured by `capture_pending()` inside it: the
    pool's segments (large and small, from `torch.cuda.memory_snapshot()`) do not grow. The config's
    logits (2 MiB at 8 tokens) take large blocks, its small tensors small ones, so both parts are used."""
    from graphcap.config.byte_counts import format_bytes
    from graphcap.memory.budget import MemoryBudget

    wide = {"model.vocab_size": 65536} if device.startswith("cuda") else {}  # the CPU has no pool to measure
    probe = tiny_config(device, quick, **wide)
    cuda = device.startswith("cuda")
    estimate = MemoryBudget(probe, "cuda" if cuda else "emulated").estimate(probe, probe_keys(probe))
    budget = max(4 * estimate, 64 << 20)
    config = tiny_config(device, quick, **wide, **{"capture.strategy": "lazy", "capture.memory_budget": budget})
    manager = CaptureManager(build_model(config), config, progress=False)
    reserved = lambda: torch.cuda.memory_reserved(device) if cuda else 0  # noqa: E731
    before = reserved()
    manager.capture()
    took = reserved() - before
    handle = manager.backend.pool.handle
    held = pool_segments(handle) if cuda else {}
    key = max(manager.registry.planned, key=lambda k: (k.uniform, -k.num_tokens))  # the smallest uniform key
    batch = fill_batch(key, config, 0)
    served = torch.allclose(manager.execute(batch).clone(), manager.eager(batch), atol=1e-3, rtol=1e-3)
    captured = manager.capture_pending()
    used = pool_segments(handle) if cuda else {}
    replayed = torch.allclose(manager.execute(batch).clone(), manager.eager(batch), atol=1e-3, rtol=1e-3)
    planned = len(manager.registry.planned)
    fits = not cuda or (took >= budget and held == used and manager.backend.pool.handle == handle)
    observed = (
        f"first step served before any capture ({'equal' if served else 'NOT equal'} to eager); {captured} of "
        f"{planned} keys captured lazily; capture() reserved {format_bytes(took)} for a budget of "
        f"{format_bytes(budget)} (estimate of the graphs {format_bytes(estimate)}); the pool's segments "
        f"{held} before the captures, {used} after (equal: the captures used the reservation); replay "
        f"{'equal' if replayed else 'NOT equal'} to eager"
    )
    ok = served and replayed and captured == planned and fits
    return {"ok": ok, "observed": observed, "reserved": took, "segments": [held, used], "budget": budget}


def pool_segments(handle) -> dict[str, int]:
    """Bytes of the allocator's segments in graph pool `handle`, by segment type (large, small)."""
    found = {"large": 0, "small": 0}
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == tuple(handle):
            found[segment["segment_type"]] += segment["total_size"]
    return found


def piecewise_order(device: str, quick: bool) -> dict:
    """Piecewise keys captured largest first into one pool (an eager op's inputs between pieces held as
    unowned aliases), then replayed out of capture order: each replay bitwise equal to eager at the same
    shape, and to the same key's first replay. A later capture reusing a break input's memory would show
    here as a difference."""
    sizes = [1, 2, 4] if quick else [1, 2, 4, 8]
    config = tiny_config(
        device,
        quick,
        **{"capture.mode": "piecewise", "model.attention": "per_request"},
        **{"capture.sizes": sizes, "capture.max_size": sizes[-1]},
    )
    manager = _manager(config)
    order = [1, 4, 2, 1, 4, 2, 2] if quick else [1, 8, 2, 4, 1, 4, 8, 2, 2, 8, 1, 4]
    first: dict[int, torch.Tensor] = {}
    bitwise_eager, bitwise_self, worst = 0, 0, 0.0
    for num_reqs in order:  # request r always writes token r at position 9 of its blocks: repeats are equal
        table = np.arange(1, 1 + num_reqs * 8, dtype=np.int32).reshape(num_reqs, 8)
        batch = StepBatch(np.ones(num_reqs, np.int32), np.full(num_reqs, 9), np.arange(num_reqs), table)
        replayed = manager.execute(batch).clone()
        expected = manager.eager(batch)
        worst = max(worst, float((replayed - expected).abs().max()))
        bitwise_eager += bool(torch.equal(replayed, expected))
        if num_reqs in first:
            bitwise_self += bool(torch.equal(replayed, first[num_reqs]))
        else:
            first[num_reqs] = replayed
    repeats = len(order) - len(first)
    observed = (
        f"{len(manager.graphs)} piecewise keys captured largest first, replayed in the order {order}: "
        f"{bitwise_eager} of {len(order)} bitwise equal to eager (max |diff| {worst:.2e}), {bitwise_self} of "
        f"{repeats} repeats bitwise equal to the key's first replay"
    )
    ok = bitwise_eager == len(order) and bitwise_self == repeats and manager.stats.piecewise_replays == len(order)
    return {"ok": ok, "observed": observed, "max_abs_diff": worst}


def probe_keys(config: CaptureConfig) -> tuple[GraphKey, ...]:
    from graphcap.keys import KeyRegistry

    return KeyRegistry.from_config(config).planned


CASES = {
    "tiny": tiny,
    "lazy_budget": lazy_budget,
    "pipelined": pipelined,
    "clobber": clobber,
    "piecewise": piecewise,
    "piecewise_order": piecewise_order,
    "agreement": agreement,
}
