"""Lazy capture across a changed static input, scratch blocks a live row holds, sampled live steps.

- lazy capture: a static input changed between `capture_pending` calls (an object replaced, a storage
  swapped with `.data =`, a `register_static` name registered again) is refused naming it, nothing captured;
  put back, every key replays equal to eager;
- scratch blocks: blocks a live row of a persistent block table (built-in or a KV group's) holds, given to
  `capture` or `capture_pending`, are refused naming the row, every KV cache byte-identical;
- sampled steps: faults that appear after capture (a wrong slice at live shapes in the output or in the KV
  slots, a host plan gone stale) are named by the first sampled step; the reference model over random steps,
  every step sampled, is never flagged and leaves its KV cache bit-identical to an unsampled twin.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from graphcap import CaptureManager, ReplayMismatchError, StaticInputMovedError, StepBatch
from graphcap.models import WindowedMemory, build_model
from graphcap.testing import assert_close, make_config, make_manager

from .live_faults import StalePlan, WrongSlice
from .trials import Row, Scale, Tally

QUERIES = [[1], [1, 1, 1], [1] * 5, [1] * 8, [2], [2, 1], [3, 2, 2], [1, 1, 1, 1, 4]]
"""Steps that reach every key of the tiny config (uniform and mixed; 2, 4 and 8 tokens)."""


def _batch(q: list[int], seed: int) -> StepBatch:
    rng = np.random.default_rng(seed)
    lens = np.array(q)
    table = np.arange(1, 1 + len(q) * 8, dtype=np.int32).reshape(len(q), 8)
    return StepBatch(lens, lens + rng.integers(0, 12, len(q)), rng.integers(0, 128, int(lens.sum())), table)


class _Scaled(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.inner = build_model(config)
        self.holder = {"scale": torch.full((1,), 1.5)}  # reached only through register_static

    def forward(self, inputs):
        return self.inner(inputs) * self.holder["scale"]


def _swap_object(manager: CaptureManager) -> tuple[str, Callable[[], None]]:
    captured = manager.model.lm_head
    manager.model.lm_head = torch.nn.Parameter(captured.detach() * 2, requires_grad=False)
    return r"parameter 'model\.lm_head' was replaced", lambda: setattr(manager.model, "lm_head", captured)


def _swap_data(manager: CaptureManager) -> tuple[str, Callable[[], None]]:
    weight = manager.model.lm_head
    saved = weight.data
    weight.data = saved.clone() * 2
    return r"'model\.lm_head' moved", lambda: setattr(weight, "data", saved)


def _register_again(manager: CaptureManager) -> tuple[str, Callable[[], None]]:
    holder, captured = manager.model.holder, manager.model.holder["scale"]
    holder["scale"] = torch.full((1,), -3.0)
    manager.register_static("scale", holder["scale"])

    def back() -> None:
        holder["scale"] = captured
        manager.register_static("scale", captured)

    return r"'static\.scale' was registered again", back


SWAPS = {"an object replaced": _swap_object, ".data = swapped": _swap_data, "register_static again": _register_again}


def lazy_trial(swap: str, seed: int) -> None:
    config = make_config({"capture.strategy": "lazy"})
    model = _Scaled(config) if swap == "register_static again" else build_model(config)
    manager = CaptureManager(model, config, progress=False)
    if swap == "register_static again":
        manager.register_static("scale", model.holder["scale"])
    first = manager.capture_pending(max_keys=1 + seed % 3)
    match, put_back = SWAPS[swap](manager)
    try:
        manager.capture_pending()
    except StaticInputMovedError as exc:
        if not re.search(match, str(exc)) or "capture_pending(): refused" not in str(exc):
            raise AssertionError(f"refused without naming it: {exc}") from None
    else:
        raise AssertionError("captured while a static input differed")
    if len(manager.graphs) != first:
        raise AssertionError("a key was captured by the refused call")
    put_back()
    manager.capture_pending()
    for i, q in enumerate(QUERIES):
        batch = _batch(q, seed * 100 + i)
        assert_close(manager.execute(batch).clone(), manager.eager(batch))


class _Hybrid(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.llama = build_model(config)
        self.memory = WindowedMemory(config, "window")

    def forward(self, inputs):
        return self.llama(inputs) + self.memory(inputs)


GROUP = {"kv_cache.groups": [{"name": "window", "block_size": 2, "num_blocks": 90, "sliding_window": 5}]}


def scratch_trial(call: str, group: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = make_config({**GROUP, **({"capture.strategy": "lazy"} if call == "capture_pending" else {})})
    manager = CaptureManager(_Hybrid(config), config, progress=False)
    caches = [manager.model.llama.kv_cache, manager.model.memory.cache]
    for i, cache in enumerate(caches):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed * 2 + i)))
    before = [cache.clone() for cache in caches]
    row = int(rng.integers(0, 8))
    scratch, group_scratch = list(range(40, 72)), {"window": list(range(60, 90))}
    live = int(rng.choice(group_scratch["window"] if group else scratch))
    table = manager.kv_group_tables["window"] if group else manager.block_table
    table.set_row(row, [live])
    where = "KV-cache group 'window'" if group else "the persistent block table"
    try:
        getattr(manager, call)(scratch_blocks=scratch, group_scratch_blocks=group_scratch)
    except ValueError as exc:
        if f"holds block {live}, which row {row} of {where}" not in str(exc):
            raise AssertionError(f"refused without naming the row: {exc}") from None
    else:
        raise AssertionError("captured over a live block")
    if manager.graphs or not all(torch.equal(c, b) for c, b in zip(caches, before)):
        raise AssertionError("something was captured or written")


def sampling_fault_trial(fault: str, seed: int) -> None:
    config = make_config({"checks.sample_every": 1 + seed % 3})
    model = StalePlan(config) if fault == "stale plan" else WrongSlice(config, fault)
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    if fault == "stale plan":
        model.tuning["scale"] = 0.5
    else:
        model.bug.fill_(1)
    for step in range(1, 4):
        batch = _batch([1, 1, 1], seed * 10 + step)  # 3 tokens: padded to 4
        try:
            manager.execute(batch)
        except ReplayMismatchError as exc:
            if exc.step != step or exc.step % manager.config.checks.sample_every or str(exc.key) not in str(exc):
                raise AssertionError(f"named another step or key: {exc}") from None
            return
    raise AssertionError("no sampled step flagged the fault")


def sampling_pass_trial(steps: int, seed: int) -> int:
    """`steps` random steps on two reference managers, one sampling every step; returns the replays compared."""
    rng = np.random.default_rng(seed)
    sampled = make_manager(make_config({"checks.sample_every": 1}))
    plain = make_manager(make_config())
    sampled.capture()
    plain.capture()
    for _ in range(steps):
        n = int(rng.integers(1, 9))
        q = rng.integers(1, 4, n).tolist()
        batch = _batch(q, int(rng.integers(0, 2**31)))
        out = sampled.execute(batch).clone()
        assert_close(out, plain.execute(batch).clone(), rtol=0, atol=0)
        if not torch.equal(sampled.model.kv_cache, plain.model.kv_cache):
            raise AssertionError("the sampled step left another KV cache")
    return sampled._sampler.checked


def checks_rows(scale: Scale) -> list[Row]:
    """The rows of the three experiments (see the module docstring)."""
    lazy, scratch, faults, passing = Tally(), Tally(), Tally(), Tally()
    for seed in range(scale.faults):
        for swap in SWAPS:
            with lazy.trial(f"{swap}, seed {seed}"):
                lazy_trial(swap, seed)
        for call in ("capture", "capture_pending"):
            for group in (False, True):
                with scratch.trial(f"{call}, group {group}, seed {seed}"):
                    scratch_trial(call, group, seed)
        for fault in ("output", "kv", "stale plan"):
            with faults.trial(f"{fault}, seed {seed}"):
                sampling_fault_trial(fault, seed)
    compared = 0
    for seed in range(scale.stress_seeds):
        with passing.trial(f"seed {seed}"):
            compared += sampling_pass_trial(scale.stress_steps // 10, seed)
    return [
        lazy.row(
            "lazy capture",
            "a static input changed between capture_pending calls (object replaced, .data swapped, register_static "
            "again), then put back",
            "capture_pending refused naming it, nothing captured; put back, every key replays == eager",
        ),
        scratch.row(
            "scratch blocks",
            "scratch blocks a live row holds (built-in table or a KV group's) x capture / capture_pending",
            "ValueError naming the row (and group) before anything is written: KV caches byte-identical",
        ),
        faults.row(
            "sampled steps",
            "faults after capture: a wrong slice at padded shapes (output, KV slots), a stale prepare() plan; "
            "sample_every 1-3",
            "ReplayMismatchError at the first sampled step, naming the key and the step",
        ),
        passing.row(
            "sampled steps",
            f"reference model, every step sampled, {scale.stress_steps // 10} random steps per seed, beside an "
            "unsampled twin",
            f"never flagged, outputs and KV cache bit-identical to the twin ({compared} sampled replays)",
        ),
    ]
