"""Reliability suite: faults during capture, hostile batches and configs, stale padding, threads.

Shared by the tests here and by `tools/reliability.py` (which runs the long campaign and
writes docs/RELIABILITY.md): one tiny configuration, a model wrapper that injects faults,
snapshots of the persistent buffers and the KV cache, a catalogue of hostile batches, a
plan-based batch fuzzer with an independent validity oracle, and the poisoned stress loop.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import yaml

from graphcap import CaptureManager, InvariantViolation, StepBatch, load_config
from graphcap.batch import dummy_batch
from graphcap.buffers import PersistentBuffers
from graphcap.config import CaptureConfig, config_from_text
from graphcap.dispatch import KeyRegistry
from graphcap.invariants import check_invariants
from graphcap.models import build_model
from graphcap.workload import Workload

# A 1-layer, 32-wide model over a cache of 4-token blocks: small enough that a capture of
# four keys takes well under a second on one CPU thread, big enough for padded tails, block
# crossings and eager fallbacks (steps above capture.max_size). 72 blocks hold 8 requests
# of max_model_len, so a stress workload never starves for blocks.
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
    "capture.max_size": 8,
    "capture.num_warmups": 1,
    "checks.invariants": "full",
    "checks.verify_replay": True,
}
# Fault injection: four keys (uniform and mixed at 4 then 2 tokens, the capture order).
FAULT_SIZES = {"capture.sizes": [2, 4], "capture.max_size": 4}


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


INT32_MAX = 2**31 - 1


def make_config(overrides: Mapping[str, Any] | None = None, /, **kwargs: Any) -> CaptureConfig:
    """TINY plus dotted `overrides`, plus keyword overrides with `__` for the dot."""
    extra = {k.replace("__", "."): v for k, v in kwargs.items()}
    return load_config(overrides={**TINY, **(overrides or {}), **extra})


def make_manager(config: CaptureConfig, *, faulty: bool = False) -> CaptureManager:
    """A manager over the reference model (wrapped in `FaultyModel` when `faulty`); one thread."""
    torch.set_num_threads(1)  # the CI machine shares two cores between jobs
    model = build_model(config)
    return CaptureManager(FaultyModel(model) if faulty else model, config, progress=False)


def kv_cache(manager: CaptureManager) -> torch.Tensor:
    return manager.model.kv_cache


# -- faults ------------------------------------------------------------------------------


class FaultyModel(torch.nn.Module):
    """The reference model with at most one armed fault, raised from `forward`.

    Calls are counted per key since `arm`: with one warmup and `verify_replay`, call 1 of a
    key is its warmup, call 2 its capture (under the backend's recorder) and call 3 the eager
    run verification compares the replay with, so `on_call` picks the phase that fails.
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fault: tuple[int, Callable[[], BaseException], int | None] | None = None
        self.calls: Counter = Counter()

    def arm(self, num_tokens: int, make_exc: Callable[[], BaseException], on_call: int | None = None) -> None:
        """Raise `make_exc()` when a key of `num_tokens` runs (on its `on_call`-th call, or every call)."""
        self.fault = (num_tokens, make_exc, on_call)
        self.calls.clear()

    def disarm(self) -> None:
        self.fault = None

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.inner.kv_cache

    def forward(self, inputs) -> torch.Tensor:
        key = inputs.key
        self.calls[key] += 1
        if self.fault is not None:
            num_tokens, make_exc, on_call = self.fault
            if key.num_tokens == num_tokens and on_call in (None, self.calls[key]):
                raise make_exc()
        return self.inner(inputs)


FAULTS: dict[str, Callable[[], BaseException]] = {
    "error": lambda: RuntimeError("injected fault: the forward failed"),
    "oom": lambda: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.8 GiB"
    ),
    "oom_no_message": lambda: torch.OutOfMemoryError(),
    "interrupt": KeyboardInterrupt,
}
PHASES = {1: "warmup", 2: "capture", 3: "verify"}


def leftover_temp_files(path: Path) -> list[Path]:
    """Temporary files `atomic_write` would leave next to `path` if it failed to clean up."""
    return sorted(path.parent.glob(f".{path.name}.*"))


def assert_nothing_left(manager: CaptureManager) -> None:
    """After a failed or interrupted pass: GC restored, no graph registered or holding memory."""
    assert gc.isenabled(), "GC left disabled"
    assert gc.get_freeze_count() == 0, "GC left frozen"
    assert manager.graphs == {}, f"graphs left registered: {list(manager.graphs)}"
    assert manager.registry.captured == set()
    assert manager.backend.graphs == (), "the backend still holds live graphs"
    assert manager.backend.memory_in_use() == 0


# -- snapshots ---------------------------------------------------------------------------


class Snapshot(NamedTuple):
    host: np.ndarray
    kv_cache: torch.Tensor
    stats: dict


def snapshot(manager: CaptureManager) -> Snapshot:
    return Snapshot(manager.buffers._host.copy(), kv_cache(manager).clone(), manager.stats.as_dict())


def assert_unchanged(manager: CaptureManager, before: Snapshot) -> None:
    """Buffers and KV cache byte-identical, and no step counted."""
    assert np.array_equal(manager.buffers._host, before.host), "a refused batch wrote the persistent buffers"
    assert torch.equal(kv_cache(manager), before.kv_cache), "a refused batch wrote the KV cache"
    assert manager.stats.as_dict() == before.stats, "a refused batch was counted as a step"


# -- hostile batches ---------------------------------------------------------------------


class Hostile(NamedTuple):
    """A batch that must be refused: its arguments, and the message naming field and index."""

    name: str
    args: tuple
    match: str
    """Regex the error message must match (names the field, and the request index if any)."""


def hostile_batches(config: CaptureConfig) -> list[Hostile]:
    """Hostile steps for `config` (TINY): each is refused by `StepBatch` or by staging."""
    vocab, nb = config.model.vocab_size, config.kv_cache.num_blocks
    mml, bs = config.kv_cache.max_model_len, config.kv_cache.block_size
    seqs, tokens = config.batching.max_num_seqs, config.batching.max_num_tokens
    width = config.kv_cache.max_blocks_per_req
    bt = [[1, 2], [3, 4]]
    return [
        Hostile("token id = vocab_size", ([1, 2], [5, 6], [1, vocab, 2], bt), rf"input_ids\[1\] \(request 1\) is {vocab}"),
        Hostile("token id far above vocab", ([2, 1], [5, 6], [1, 2, 10**6], bt), r"input_ids\[2\] \(request 1\)"),
        Hostile("negative token id", ([2, 1], [5, 6], [1, -3, 2], bt), r"input_ids\[1\] is -3"),
        Hostile("token id above int32", ([1, 1], [5, 6], [1, 2**40], bt), r"input_ids holds \d+, above the int32"),
        Hostile("negative query_len", ([1, -2], [5, 6], None, bt), r"query_lens\[1\] is -2"),
        Hostile("zero query_len", ([0, 1], [5, 6], None, bt), r"query_lens\[0\] is 0"),
        Hostile("negative seq_len", ([1, 1], [5, -6], None, bt), r"seq_lens\[1\] is -6"),
        Hostile("seq_len below query_len", ([1, 3], [5, 2], None, bt), r"seq_lens\[1\] is 2 but query_lens\[1\] is 3"),
        Hostile("seq_len above int32", ([1, 1], [5, 2**33], None, bt), r"seq_lens\[1\] is \d+, above the int32"),
        Hostile("seq_len above max_model_len", ([1, 1], [5, mml + 1], None, [[1] * width] * 2), rf"seq_lens\[1\] is {mml + 1}, above max_model_len"),
        Hostile("huge seq_len in a big block table", ([1], [10**6], None, [[1] * width]), r"seq_lens\[0\] is 1000000, above max_model_len"),
        Hostile("block id = num_blocks", ([1, 1], [5, 6], None, [[1, 2], [3, nb]]), rf"block_table\[1, 1\] is {nb}, outside the KV cache"),
        Hostile("negative block id", ([1, 1], [5, 6], None, [[1, -1], [3, 4]]), r"block_table\[0, 1\] is -1"),
        Hostile("block id above int32", ([1, 1], [5, 6], None, [[1, 2**35], [3, 4]]), r"block_table holds \d+, above the int32"),
        Hostile("block table too narrow", ([1, 1], [5, 3 * bs], None, bt), r"request 1 has seq_len 12, which needs 3 blocks.*block_table has 2 columns"),
        Hostile("block table too wide", ([1], [5], None, [[1] * (width + 1)]), rf"block_table has {width + 1} columns"),
        Hostile("more requests than max_num_seqs", ([1] * (seqs + 1), [3] * (seqs + 1), None, None), rf"{seqs + 1} requests, above batching\.max_num_seqs"),
        Hostile("more tokens than max_num_tokens", ([tokens + 1], [tokens + 1], None, None), rf"{tokens + 1} tokens, above batching\.max_num_tokens"),
        Hostile("fewer seq_lens than query_lens", ([1, 1, 1], [5, 6], None, None), r"seq_lens has 2 entries but query_lens has 3"),
        Hostile("too few token ids", ([2, 1], [5, 6], [1, 2], bt), r"input_ids has 2 entries but query_lens sum to 3"),
        Hostile("block table rows != requests", ([1, 1], [5, 6], None, [[1, 2]]), r"block_table has 1 rows but the batch has 2"),
        Hostile("float query_lens", (np.array([1.0, 2.0]), [5, 6], None, bt), r"query_lens must hold integers; got dtype float64"),
        Hostile("float token ids", ([1, 1], [5, 6], np.array([1.0, 2.0]), bt), r"input_ids must hold integers"),
        Hostile("bool seq_lens", ([1, 1], np.array([True, True]), None, bt), r"seq_lens must hold integers; got dtype bool"),
        Hostile("string token ids", ([1, 1], [5, 6], ["a", "b"], bt), r"input_ids must hold integers"),
        Hostile("2-D query_lens", ([[1, 1]], [5, 6], None, bt), r"query_lens must be 1-D"),
        Hostile("1-D block table", ([1, 1], [5, 6], None, [1, 2]), r"block_table must be 2-D"),
        Hostile("ragged block table", ([1, 1], [5, 6], None, [[1, 2], [3]]), r"block_table must be a 2-D array of integers"),
        Hostile("uint64 above int32", (np.array([1, 1], np.uint64), np.array([5, 2**40], np.uint64), None, bt), r"seq_lens holds \d+, above the int32"),
        Hostile("int8 negative block id", ([1, 1], [5, 6], None, np.array([[1, -1], [3, 4]], np.int8)), r"block_table\[0, 1\] is -1"),
        Hostile("int16 negative token id", ([1, 1], [5, 6], np.array([7, -1], np.int16), bt), r"input_ids\[1\] is -1"),
        Hostile("byte-swapped negative token id", ([1, 1], [5, 6], np.array([7, -(2**31)], ">i4"), bt), r"input_ids\[1\] is -2147483648"),
    ]  # fmt: skip


# -- fuzzed batches ----------------------------------------------------------------------

# How a field's integers are handed to StepBatch. Integer forms keep the values (when they
# fit); the others must be refused naming the field.
INT_FORMS = ("list", "int32", "int64", "int8", "uint16", "uint64", ">i4", "strided")
BAD_FORMS = ("float64", "bool", "wrong_ndim", "ragged", "str")
_DTYPES = {"int32": np.int32, "int64": np.int64, "int8": np.int8, "uint16": np.uint16, "uint64": np.uint64}


@dataclass
class BatchPlan:
    """Integers of one step plus the form each field is handed over in."""

    query_lens: list[int]
    seq_lens: list[int]
    input_ids: list[int] | None = None
    block_table: list[list[int]] | None = None
    forms: dict[str, str] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {
            "query_lens": self.query_lens,
            "seq_lens": self.seq_lens,
            "input_ids": self.input_ids,
            "block_table": self.block_table,
        }

    def build(self) -> dict[str, Any]:
        """The StepBatch keyword arguments; an integer form that cannot hold the values becomes a list."""
        out = {}
        for name, values in self.fields().items():
            form = self.forms.get(name, "list")
            if values is None:
                out[name] = None
            elif form in BAD_FORMS:
                out[name] = _bad_form(values, form)
            else:
                out[name] = _int_form(values, form)
        return out

    def effective_forms(self) -> dict[str, str]:
        """Forms as built: a bad form only applies to a field with values."""
        out = {}
        for name, values in self.fields().items():
            form = self.forms.get(name, "list")
            out[name] = form if form in BAD_FORMS and values is not None and _flat(values) else "int"
        return out


def _flat(values) -> list[int]:
    return [v for row in values for v in row] if values and isinstance(values[0], list) else list(values)


def _int_form(values, form: str):
    if form == "list":
        return values
    flat = _flat(values)
    if form == "strided":  # a non-contiguous int64 view
        base = np.zeros((len(flat), 2), np.int64) if flat else np.zeros((0, 2), np.int64)
        base[:, 0] = flat
        view = base[:, 0]
        return view.reshape(len(values), len(values[0])) if values and isinstance(values[0], list) else view
    dtype = np.dtype(">i4") if form == ">i4" else np.dtype(_DTYPES[form])
    info = np.iinfo(dtype)
    if any(v < info.min or v > info.max for v in flat):
        return values
    if values and isinstance(values[0], list):
        return np.array(values, dtype=dtype).reshape(len(values), len(values[0]))
    return np.array(values, dtype=dtype)


def _bad_form(values, form: str):
    flat = _flat(values)
    if not flat:
        return values
    two_d = isinstance(values[0], list)
    if form == "float64":
        return np.array(values, dtype=np.float64)
    if form == "bool":
        return np.array(values) != 0
    if form == "str":
        return [str(v) for v in flat] if not two_d else [[str(v) for v in row] for row in values]
    if form == "wrong_ndim":
        return flat if two_d else [flat]
    # ragged
    rows = values if two_d else [flat]
    return [rows[0], [*rows[0], 1]] if len(rows) == 1 else [rows[0], rows[1][:-1] or [1, 1], *rows[2:]]


@dataclass(frozen=True)
class Limits:
    """The bounds of a config that decide whether a step is valid."""

    vocab_size: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_tokens: int
    max_blocks_per_req: int

    @classmethod
    def of(cls, config: CaptureConfig) -> Limits:
        kv = config.kv_cache
        return cls(
            config.model.vocab_size,
            kv.num_blocks,
            kv.block_size,
            kv.max_model_len,
            config.batching.max_num_seqs,
            config.batching.max_num_tokens,
            kv.max_blocks_per_req,
        )


def violations(plan: BatchPlan, lim: Limits) -> set[str]:
    """The oracle, written apart from graphcap: every rule the step breaks (empty: valid).

    Returns the names a refusal may cite; graphcap checks in its own order, so its message
    must name at least one of them.
    """
    bad = {name for name, form in plan.effective_forms().items() if form != "int"}
    q, s, ids, bt = plan.query_lens, plan.seq_lens, plan.input_ids, plan.block_table
    if len(q) != len(s):
        bad |= {"seq_lens", "query_lens"}
    if any(v < 1 for v in q):
        bad.add("query_lens")
    if any(v > INT32_MAX for v in q + s):
        bad |= {"seq_lens", "query_lens"}
    if any(b < a for a, b in zip(q, s)):
        bad |= {"seq_lens", "query_lens"}
    num_tokens = sum(q)
    if ids is not None:
        if len(ids) != num_tokens:
            bad.add("input_ids")
        if any(v < 0 or v >= lim.vocab_size for v in ids):
            bad.add("input_ids")
    if bt is not None:
        width = len(bt[0]) if bt else 0
        if len(bt) != len(q):
            bad.add("block_table")
        if any(v < 0 or v > INT32_MAX for row in bt for v in row):
            bad.add("block_table")
        if q:  # staging checks the table only for a step with requests
            if any(v >= lim.num_blocks for row in bt for v in row) or width > lim.max_blocks_per_req:
                bad.add("block_table")
            if s and max(s) > width * lim.block_size:
                bad.add("block_table")
    if len(q) > lim.max_num_seqs:
        bad.add("max_num_seqs")
    if num_tokens > lim.max_num_tokens:
        bad.add("max_num_tokens")
    if s and max(s) > lim.max_model_len:
        bad |= {"seq_lens", "max_model_len"}
    return bad


def random_plan(rng: np.random.Generator, lim: Limits) -> BatchPlan:
    """A random step: mostly valid, often with one or a few hostile changes."""
    num_reqs = int(rng.integers(0, lim.max_num_seqs + 1))
    q = [int(v) for v in rng.integers(1, 6, num_reqs)] if rng.random() < 0.7 else [1] * num_reqs
    s = [v + int(rng.integers(0, lim.max_model_len - v + 1)) for v in q]
    ids = [int(v) for v in rng.integers(0, lim.vocab_size, sum(q))] if rng.random() < 0.8 else None
    bt = None
    if rng.random() < 0.8:
        need = max((-(-v // lim.block_size) for v in s), default=0)
        width = int(rng.integers(need, lim.max_blocks_per_req + 1))
        bt = [[int(v) for v in rng.integers(1, lim.num_blocks, width)] for _ in range(num_reqs)]
    plan = BatchPlan(q, s, ids, bt)
    for _ in range(int(rng.choice([0, 0, 1, 1, 2, 3]))):
        _mutate(plan, rng, lim)
    for name in ("query_lens", "seq_lens", "input_ids", "block_table"):
        plan.forms[name] = str(rng.choice(BAD_FORMS if rng.random() < 0.05 else INT_FORMS))
    return plan


_ABSURD = (-(2**40), -(2**31), -1, 0, 2**31 - 1, 2**31, 2**40, 2**62)


def _mutate(plan: BatchPlan, rng: np.random.Generator, lim: Limits) -> None:
    kind = int(rng.integers(0, 10))
    q, s = plan.query_lens, plan.seq_lens
    pick = int(rng.integers(0, 4))
    absurd = int(rng.choice(_ABSURD))
    near = int(rng.choice([lim.vocab_size, lim.num_blocks, lim.max_model_len, lim.max_model_len + 1, -1]))
    value = absurd if rng.random() < 0.5 else near
    if kind == 0 and q:
        q[int(rng.integers(0, len(q)))] = value
    elif kind == 1 and s:
        s[int(rng.integers(0, len(s)))] = value
    elif kind == 2 and plan.input_ids:
        plan.input_ids[int(rng.integers(0, len(plan.input_ids)))] = value
    elif kind == 3 and plan.block_table and plan.block_table[0]:
        plan.block_table[int(rng.integers(0, len(plan.block_table)))][0] = value
    elif kind == 4:  # lengths disagree
        target = [q, s, plan.input_ids or []][pick % 3]
        if target and rng.random() < 0.5:
            target.pop()
        else:
            target.append(1)
    elif kind == 5 and plan.block_table is not None:
        if plan.block_table and rng.random() < 0.5:
            plan.block_table.pop()
        else:
            plan.block_table = [[*row, 1] for row in plan.block_table] * 2 or [[1]]
    elif kind == 6:  # too many requests or tokens
        extra = lim.max_num_seqs + 1 if pick % 2 else 1
        q += [lim.max_num_tokens // extra + 1] * extra
        s += [lim.max_num_tokens // extra + 1] * extra
        plan.input_ids, plan.block_table = None, None
    elif kind == 7 and plan.block_table:  # too wide or too narrow
        plan.block_table = (
            [row[:1] for row in plan.block_table]
            if pick % 2
            else [row + [1] * (lim.max_blocks_per_req) for row in plan.block_table]
        )
    elif kind == 8 and s:  # long sequences
        s[int(rng.integers(0, len(s)))] = lim.max_model_len + int(rng.integers(1, 4))
    elif kind == 9:
        plan.query_lens, plan.seq_lens, plan.input_ids, plan.block_table = [], [], None, None


REFUSALS = (ValueError, InvariantViolation)
"""The documented exceptions a hostile step may raise; anything else escaping is a bug."""


def check_plan(manager: CaptureManager, plan: BatchPlan, lim: Limits) -> str:
    """Run one planned step through `execute`; return "accepted" or "refused", else raise.

    Valid (by the oracle): must be accepted, and graph (or eager fallback) == eager.
    Invalid: must be refused with a documented exception naming a violated field, with the
    buffers, the KV cache and the stats byte-identical.
    """
    expected = violations(plan, lim)
    before = snapshot(manager)
    try:
        batch = StepBatch(**plan.build())
        out = manager.execute(batch).clone()
    except REFUSALS as exc:
        if not expected:
            raise AssertionError(f"valid step refused: {exc}\n{plan}") from exc
        if not any(name in str(exc) for name in expected):
            raise AssertionError(f"refusal names none of {sorted(expected)}: {exc}\n{plan}") from exc
        assert_unchanged(manager, before)
        return "refused"
    if expected:
        raise AssertionError(f"invalid step accepted (oracle: {sorted(expected)})\n{plan}")
    torch.testing.assert_close(out, manager.eager(batch))
    return "accepted"


# -- poisoned stress ---------------------------------------------------------------------


@dataclass
class StressResult:
    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0
    uniform_steps: int = 0
    mixed_steps: int = 0
    real_rows: int = 0


def stress(manager: CaptureManager, num_steps: int, seed: int, *, spec_len: int = 1) -> StressResult:
    """Random engine-like steps, large and small; every real row of every step: graph == eager.

    Requests join, prefill in chunks, decode (or verify `spec_len` drafts) and finish; the
    token budget per step is drawn anew, so steps range from one token to above the largest
    captured size (eager). Raises AssertionError on the first differing step.
    """
    config = manager.config
    workload = Workload(config, seed=seed, chunk=int(np.random.default_rng(seed).integers(3, 12)), spec_len=spec_len)
    rng = workload.rng
    result = StressResult()
    budgets = [1, 2, 3, 4, 5, 8, 8, 12, config.batching.max_num_tokens]
    while result.steps < num_steps:
        # New requests keep arriving (so prefill chunks mix with decodes), up to the limit.
        if not workload.running or (len(workload.running) < config.batching.max_num_seqs and rng.random() < 0.3):
            prompt_len = int(rng.integers(1, int(rng.choice([2, 6, 16])) + 1))
            workload.add(prompt_len, max_new_tokens=int(rng.integers(1, 12)))  # short: turnover
        batch = workload.next_batch(max_tokens=int(rng.choice(budgets)))
        if batch.num_reqs == 0:
            workload.advance(None)
            continue
        key = manager.dispatch(batch)
        out = manager.execute(batch).clone()
        ref = manager.eager(batch)
        try:
            torch.testing.assert_close(out, ref)
        except AssertionError as exc:
            raise AssertionError(f"step {result.steps} ({batch}, key {key}): graph != eager\n{exc}") from None
        workload.advance(out)
        result.steps += 1
        result.real_rows += batch.num_tokens
        if key is None:
            result.eager_steps += 1
        else:
            result.graph_steps += 1
            result.uniform_steps += key.uniform
            result.mixed_steps += not key.uniform
    return result


# -- configs -----------------------------------------------------------------------------


def assert_config_works(config: CaptureConfig) -> None:
    """A config that loads round-trips, plans its keys, and stages every dummy batch cleanly."""
    assert config_from_text(yaml.safe_dump(config.to_dict())) == config
    registry = KeyRegistry.from_config(config)
    kv = config.kv_cache
    cells = config.batching.max_num_tokens * 3 + config.batching.max_num_seqs * (kv.max_blocks_per_req + 2)
    if cells > 4_000_000 or len(registry) > 64:
        return  # valid, but too big to allocate in a unit test
    buffers = PersistentBuffers.from_config(config)
    for key in registry.capture_order():
        inputs = buffers.stage(dummy_batch(key, max_model_len=kv.max_model_len), key)
        check_invariants(inputs, "full")


# -- threads -----------------------------------------------------------------------------

NUM_THREADS = 3
STEPS_PER_THREAD = 40


def thread_batches(thread: int) -> list[StepBatch]:
    """Steps of one thread over its own KV blocks: decodes, a mixed step, an eager prefill.

    Each is self-contained (`seq_lens == query_lens`: it writes every KV slot it reads), so
    its output does not depend on what ran before and is checked bit for bit.
    """
    base = 1 + 20 * thread
    rng = np.random.default_rng(thread)

    def ids(n):
        return rng.integers(0, 128, n)

    return [
        StepBatch([1, 1], [1, 1], ids(2), [[base], [base + 1]]),  # uniform, 2 tokens
        StepBatch([2, 1], [2, 1], ids(3), [[base + 2], [base + 3]]),  # mixed, pads to 4
        StepBatch([1] * 5, [1] * 5, ids(5), [[base + 4 + i] for i in range(5)]),  # uniform, pads to 8
        StepBatch([7, 5], [7, 5], ids(12), [[base + 9, base + 10], [base + 11, base + 12]]),  # eager
    ]


def expected_outputs(manager: CaptureManager) -> dict[tuple[int, int], torch.Tensor]:
    """Every thread's steps, run one at a time: the reference for the threaded runs."""
    return {
        (thread, i): manager.execute(batch).clone()
        for thread in range(NUM_THREADS)
        for i, batch in enumerate(thread_batches(thread))
    }


class EventLog:
    """While entered, records (kind, thread) for every staging and every replay or eager run.

    Patches the manager's buffers, forward and graphs (restored on exit) and sleeps briefly
    after each staging to invite a thread switch between staging and replay.
    """

    def __init__(self, manager: CaptureManager, *, pause: float = 2e-4) -> None:
        self.manager = manager
        self.pause = pause
        self.events: list[tuple[str, str]] = []
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def __enter__(self) -> EventLog:
        manager = self.manager
        self._patch(manager.buffers, "stage", "stage", pause=True)
        self._patch(manager, "_forward", "run")
        for graph in manager.graphs.values():
            self._patch(graph, "replay", "run")
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, had, old in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()

    def _patch(self, obj: Any, name: str, kind: str, *, pause: bool = False) -> None:
        fn = getattr(obj, name)
        self._undo.append((obj, name, name in vars(obj), vars(obj).get(name)))

        def wrapped(*args, **kwargs):
            self.events.append((kind, threading.current_thread().name))
            result = fn(*args, **kwargs)
            if pause:
                time.sleep(self.pause)
            return result

        setattr(obj, name, wrapped)

    def interleavings(self) -> int:
        """Steps whose staging and run were not back to back in one thread."""
        events, bad = self.events, len(self.events) % 2
        for i in range(0, len(events) - 1, 2):
            (kind_a, thread_a), (kind_b, thread_b) = events[i], events[i + 1]
            bad += not (kind_a == "stage" and kind_b == "run" and thread_a == thread_b)
        return bad


def run_threads(
    manager: CaptureManager, expected: dict, *, seed: int = 0, extra: Callable[[], object] | None = None
) -> tuple[int, list[BaseException]]:
    """NUM_THREADS threads run their steps in random order, reading each result under
    `manager.lock`; `extra` runs in one more thread. Returns (mismatched outputs, errors)."""
    mismatches = [0]
    errors: list[BaseException] = []
    start = threading.Barrier(NUM_THREADS + (extra is not None))

    def worker(thread: int) -> None:
        batches = thread_batches(thread)
        order = np.random.default_rng(1000 * seed + thread).integers(0, len(batches), STEPS_PER_THREAD)
        start.wait()
        try:
            for i in order:
                with manager.lock:
                    out = manager.execute(batches[i]).clone()
                if not torch.equal(out, expected[thread, int(i)]):
                    mismatches[0] += 1
        except BaseException as exc:  # reported by the caller, not lost in the thread
            errors.append(exc)

    def side() -> None:
        start.wait()
        try:
            extra()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,), name=f"worker-{t}") for t in range(NUM_THREADS)]
    if extra is not None:
        threads.append(threading.Thread(target=side, name="side"))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if any(t.is_alive() for t in threads):
        raise AssertionError("a thread hung")
    return mismatches[0], errors


class NoLock:
    """Stands in for the manager's lock in the control experiment (steps then interleave)."""

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False
