"""A batch fuzzer with an oracle written apart from graphcap, and a config smoke check.

`random_plan` draws a step (mostly valid, often with hostile edits and odd dtypes);
`violations` decides, without graphcap's code, which rules it breaks; `check_plan` runs it
through `execute` and holds graphcap to the oracle: valid steps accepted and equal to eager,
invalid ones refused naming a broken field with nothing written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import yaml

from graphcap.batch import StepBatch, dummy_batch
from graphcap.capture.verification import assert_close
from graphcap.checks.invariants import check_invariants
from graphcap.config import CaptureConfig, config_from_text
from graphcap.errors import BatchError, InvariantViolation
from graphcap.fields import INT32_MAX
from graphcap.keys import KeyRegistry
from graphcap.manager import CaptureManager
from graphcap.staging import PersistentBuffers
from graphcap.testing.faults import assert_unchanged, expect, snapshot

__all__ = [
    "BAD_FORMS",
    "INT_FORMS",
    "REFUSALS",
    "BatchPlan",
    "Limits",
    "assert_config_works",
    "check_plan",
    "random_plan",
    "violations",
]

# How a field's integers are handed to StepBatch. Integer forms keep the values (when they
# fit); the others must be refused naming the field.
INT_FORMS = ("list", "int32", "int64", "int8", "uint16", "uint64", ">i4", "strided")
BAD_FORMS = ("float64", "bool", "wrong_ndim", "ragged", "str")
_DTYPES: dict[str, type[np.integer[Any]]] = {
    "int32": np.int32,
    "int64": np.int64,
    "int8": np.int8,
    "uint16": np.uint16,
    "uint64": np.uint64,
}


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
        out: dict[str, Any] = {}
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
    dtype: np.dtype[np.integer[Any]] = np.dtype(">i4") if form == ">i4" else np.dtype(_DTYPES[form])
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
    full: bool = False
    """`checks.invariants: full`: the KV rules (no null block in a real request, one slot per token) apply."""

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
            config.checks.invariants == "full",
        )

    @property
    def probe_sizes(self) -> dict[str, int]:
        """The sizes `graphcap.probe.probe_batch` takes, as its keyword arguments."""
        return {
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "vocab_size": self.vocab_size,
        }


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
    if bt is not None and not bad:  # every level: a real token's KV slot never lies in the null block 0
        for row, query_len, seq_len in zip(bt, q, s):
            if any(row[p // lim.block_size] == 0 for p in range(seq_len - query_len, seq_len)):
                bad.add("slot_mapping")
    if lim.full and bt is not None and not bad - {"slot_mapping"}:
        # A real request never reads or writes the null block; no two tokens write one slot.
        written = set()
        for row, query_len, seq_len in zip(bt, q, s):
            if 0 in row[: -(-seq_len // lim.block_size)]:
                bad.add("block_table")
            for position in range(seq_len - query_len, seq_len):
                slot = row[position // lim.block_size] * lim.block_size + position % lim.block_size
                if slot in written:
                    bad.add("slot_mapping")
                written.add(slot)
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
        # Every request its own blocks while the cache has them (then blocks repeat: a shared
        # block is a valid step only where no two tokens write one slot, which the oracle decides).
        blocks = [int(v) for v in rng.permutation(lim.num_blocks - 1) + 1]
        blocks = (blocks * (num_reqs * width // len(blocks) + 1))[: num_reqs * width]
        bt = [blocks[i * width : (i + 1) * width] for i in range(num_reqs)]
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


REFUSALS = (BatchError, InvariantViolation)
"""The documented exceptions a refused step raises; anything else escaping is a bug."""


def check_plan(manager: CaptureManager, plan: BatchPlan, lim: Limits) -> str:
    """Run one planned step through `execute`; return "accepted" or "refused", else raise.

    Valid (by the oracle): must be accepted, and graph (or eager fallback) == eager.
    Invalid: must be refused with a documented exception naming a violated field, with the KV
    cache and the stats byte-identical, and the staging buffers too for a `BatchError` (an
    `InvariantViolation` is a rule on the staged rows: they were written, then refused before
    any graph or model read them).
    """
    expected = violations(plan, lim)
    before = snapshot(manager)
    try:
        batch = StepBatch(**plan.build())
        out = cast(torch.Tensor, manager.execute(batch)).clone()
    except REFUSALS as exc:
        if not expected:
            raise AssertionError(f"valid step refused: {exc}\n{plan}") from exc
        if not any(name in str(exc) for name in expected):
            raise AssertionError(f"refusal names none of {sorted(expected)}: {exc}\n{plan}") from exc
        assert_unchanged(manager, before, buffers=isinstance(exc, BatchError))
        return "refused"
    if expected:
        raise AssertionError(f"invalid step accepted (oracle: {sorted(expected)})\n{plan}")
    assert_close(out, manager.eager(batch))
    return "accepted"


def assert_config_works(config: CaptureConfig) -> None:
    """A config that loads round-trips, plans its keys, and stages every dummy batch cleanly."""
    expect(config_from_text(yaml.safe_dump(config.to_dict())) == config, "the config does not round-trip")
    registry = KeyRegistry.from_config(config)
    kv = config.kv_cache
    cells = config.batching.max_num_tokens * 3 + config.batching.max_num_seqs * (kv.max_blocks_per_req + 2)
    if cells > 4_000_000 or len(registry) > 64:
        return  # valid, but too big to allocate in a unit test
    buffers = PersistentBuffers.from_config(config)
    for key in registry.capture_order():
        batch = dummy_batch(registry.capture_shape(key), max_model_len=kv.max_model_len)
        inputs = buffers.stage(batch, key)
        check_invariants(inputs, "full", dummy=True)
