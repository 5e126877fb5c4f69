"""Reliability campaign: bad configs, fuzzed steps, capture faults, poisoned stress, threads, the command line.

Runs everything the reliability suite (`tests/reliability/`) checks, many more times, and
writes docs/RELIABILITY.md: date, machine, command, and one table row per experiment with
its count and outcome ("refused with ConfigError naming the key: 412/412"). Exits 1 when
any outcome is short of its count (the failures are listed in the document).

    python tools/reliability.py                       # full campaign, writes docs/RELIABILITY.md
    python tools/reliability.py --quick --out /tmp/R.md   # smoke test (seconds)

The checks themselves (fault-injecting model, hostile steps and their oracle, the poisoned
stress loop, the threaded runs) live in `graphcap.testing`, shared with the tests, so the
campaign and the suite cannot drift apart. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import re
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from graphcap import BatchError, CaptureError, CaptureManager, StaticInputMovedError, StepBatch
from graphcap.config import (
    BatchingConfig,
    CaptureSectionConfig,
    ChecksConfig,
    ConfigError,
    KVCacheConfig,
    ModelConfig,
    PadRules,
    ReportConfig,
    config_from_text,
    load_config,
)
from graphcap.keys import KeyRegistry
from graphcap.report import atomic_write
from graphcap.testing import (
    FAULT_SIZES,
    FAULTS,
    MOVES,
    REFUSALS,
    TINY,
    EventLog,
    Limits,
    NoLock,
    assert_config_works,
    assert_nothing_left,
    assert_unchanged,
    check_plan,
    expected_outputs,
    fill_batch,
    hostile_batches,
    leftover_temp_files,
    make_config,
    make_manager,
    nested,
    random_plan,
    run_threads,
    snapshot,
    stress,
    violations,
)
from graphcap.testing.cli_cases import CLI_CASES, check_case
from graphcap.testing.dp_agreement import mismatched_world
from graphcap.testing.interrupts import STAGES, interrupt_at, interrupted_cleanly
from graphcap.testing.outputs import (
    DECLARED,
    INF_WHEN_STORED,
    NULL_BLOCK_STEPS,
    LastTokenLogits,
    WholeBuffer,
    check_inf_refused,
    check_null_block_refused,
    check_output_rows,
    check_whole_buffer,
    check_wrong_cut_refused,
    whole_spec,
)

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets"
SPEC = {"capture.uniform_query_len": 4, "capture.sizes": [4, 8]}
OLD_REPORT = '{"graphcap_report": 1, "note": "the complete report of an earlier pass"}\n'


@dataclasses.dataclass
class Scale:
    random_docs: int
    combos: int
    plans: int
    faults: int
    report_writes: int
    stress_seeds: int
    stress_steps: int
    thread_rounds: int
    control_rounds: int
    cli_cases_per_area: int | None
    """None: every case of `graphcap.testing.cli_cases` (the quick run takes the first of each area)."""
    interrupts: int
    dp_worlds: tuple[int, ...]
    lifecycle_seeds: int
    lifecycle_steps: int
    lifecycle_cycles: int
    every_move_at_every_level: bool = True
    """False (the quick run): each way of moving a static input at one invariant level, the levels in turn."""


FULL = Scale(2000, 300, 5000, 8, 6, 4, 2500, 20, 5, None, 12, (2, 3), 3, 60, 10)
QUICK = Scale(60, 20, 200, 1, 2, 1, 150, 2, 1, 1, 1, (2,), 1, 24, 2, False)


@dataclasses.dataclass
class Row:
    area: str
    what: str
    count: int
    outcome: str
    passed: int
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.passed == self.count and not self.failures


class Tally:
    """Counts trials of one experiment; a trial passes when its body raises nothing."""

    def __init__(self) -> None:
        self.count = self.passed = 0
        self.failures: list[str] = []

    @contextmanager
    def trial(self, label: str) -> Iterator[None]:
        self.count += 1
        try:
            yield
        except Exception as exc:  # a failed check: recorded, the campaign goes on
            text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
            self.failures.append(f"{label}: {text[:300]}")
        else:
            self.passed += 1

    def row(self, area: str, what: str, outcome: str, count: int | None = None) -> Row:
        return Row(
            area,
            what,
            self.count if count is None else count,
            f"{outcome}: {self.passed}/{self.count}",
            self.passed,
            self.failures[:5],
        )


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- configs -----------------------------------------------------------------------------

SECTIONS = (ModelConfig, BatchingConfig, KVCacheConfig, CaptureSectionConfig, ChecksConfig, ReportConfig, PadRules)


BASE = nested(TINY)


def field_edits() -> list[tuple[str, Any, str]]:
    """One bad value per (field, kind of mistake): `(dotted key, value, what is wrong)`."""
    edits: list[tuple[str, Any, str]] = []
    for cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{cls._key}.{f.name}"
            hint = hints[f.name]
            options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None)) else (hint,)
            meta = f.metadata or {}
            literal = [o for o in options if typing.get_origin(o) is typing.Literal]
            sized = int in options and str in options  # bytes or a size word (capture.memory_budget)
            if sized:
                edits += [(key, "lots", "a word that is not a size"), (key, "-4GiB", "a negative size")]
                edits += [(key, 0, "zero bytes"), (key, 2.5, "a fraction of a byte")]
            elif int in options or float in options:
                edits += [(key, "many", "a word for a number"), (key, "8", "a quoted number")]
            if float in options:
                edits.append((key, math.inf, "an infinite number"))
            if bool in options:
                edits += [(key, "off", "a YAML 1.1 boolean word"), (key, 1, "an integer for a boolean")]
            if literal:
                edits += [(key, "bogus", "not one of the choices"), (key, True, "a boolean for a choice")]
            if str in options and not sized:
                edits.append((key, 17, "a number for a string"))
            tuples = [typing.get_args(o)[0] for o in options if typing.get_origin(o) is tuple]
            if int in tuples:
                edits += [
                    (key, [8, 4], "sizes not ascending"),
                    (key, [0, 4], "a size of 0"),
                    (key, [2.5], "a float size"),
                ]
            elif tuples:  # a list of mappings (kv_cache.groups): each entry's own keys are named by index
                edits += [(key, "window", "a word for a list"), (key, {"name": "window"}, "a mapping for a list")]
            if meta.get("min") is not None:
                edits.append((key, meta["min"] - 1, "below the minimum"))
            if meta.get("max") is not None:
                edits.append((key, meta["max"] + 1, "above the maximum"))
            if meta.get("gt") is not None:
                edits.append((key, meta["gt"], "at the exclusive bound"))
            edits.append((f"{key}x", 1, "an unknown key (typo)"))
        edits.append((cls._key, [1, 2], "a section that is not a mapping"))
    return edits


CROSS_EDITS = [
    ("device", "tpu", "an unknown device"),
    ("devices", "cpu", "an unknown top-level key"),
    ("capture.max_size", 64, "max_size above batching.max_num_tokens"),
    ("kv_cache.max_model_len", 1000, "max_model_len above the KV cache"),
    ("model.num_heads", 3, "num_heads not dividing hidden_size"),
    ("model.num_kv_heads", 3, "num_kv_heads not dividing num_heads"),
    ("batching.max_num_seqs", 33, "max_num_seqs above max_num_tokens"),
    ("padding.token_id", 128, "pad token outside the vocabulary"),
    ("padding.block_id", 72, "pad block outside the cache"),
    ("padding.position", 32, "pad position at max_model_len"),
    ("padding.seq_len", 0, "pad seq_len below pad query_len"),  # BASE_EXTRA sets padding.query_len: 1
    ("report.path", "out.txt", "report path with an unknown suffix"),
]


# What a cross-field edit needs besides its own key to be wrong.
BASE_EXTRA = {"pad seq_len below pad query_len": ("padding", "query_len", 1)}


def _edited(edits: list[tuple[str, Any, str]]) -> str:
    doc = json.loads(json.dumps(BASE))
    for section, key, value in (BASE_EXTRA[what] for _, _, what in edits if what in BASE_EXTRA):
        doc.setdefault(section, {})[key] = value
    for dotted, value, _ in edits:
        section, _, key = dotted.partition(".")
        if not key:
            doc[section] = value
        elif isinstance(doc.get(section), dict) or section not in doc:
            doc.setdefault(section, {})[key] = value
    return yaml.safe_dump(doc, sort_keys=False)


def _expect_keys(text: str, keys: set[str]) -> None:
    try:
        config_from_text(text, "generated.yaml")
    except ConfigError as exc:
        named = {p.key for p in exc.problems}
        missing = keys - named
        if missing:
            raise AssertionError(f"keys not named: {sorted(missing)}; named {sorted(named)}") from None
        located = [p for p in exc.problems if p.key in keys and not (p.where or "").startswith("generated.yaml:")]
        if located:
            raise AssertionError(f"no file:line for {located[0].key}") from None
        return
    raise AssertionError("the config loaded")


HOSTILE_YAML = {
    "list nested 3000 deep": "model: " + "[" * 3000 + "]" * 3000,
    "mapping nested 3000 deep": "model: " + "{a: " * 3000 + "1" + "}" * 3000,
    "alias inside its own anchor": "x: &a [*a]\n",
    "alias bomb (10**9 values)": "\n".join(
        ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
        + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    ),
    "python object tag": 'model: !!python/object/apply:os.system ["echo pwned"]',
    "binary tag": "model: !!binary aGVsbG8=",
    "merge key": "base: &b {hidden_size: 32}\nmodel:\n  <<: *b\n",
    "duplicate key": "model:\n  hidden_size: 32\n  hidden_size: 64\n",
    "tab indentation": "model:\n\thidden_size: 32\n",
    "NUL byte": "model: {name: tiny\x00}\n",
    "two documents": "model: {}\n---\nmodel: {}\n",
    "root is a list": "- model\n- batching\n",
    "root is a number": "42\n",
    "non-string key": "model: {1: 2}\n",
    "huge integer": "batching: {max_num_tokens: 100000000000000000000000000}\n",
    "NaN": "model: {rope_theta: .nan}\n",
}


def random_document(rng: np.random.Generator) -> str:
    """TINY with random edits (keys, types, nesting) and sometimes a textual corruption."""
    doc = json.loads(json.dumps(BASE))
    # Mostly plausible values (so a fair share of documents is valid), some absurd ones.
    scalars = [
        None,
        True,
        False,
        -1,
        0,
        1,
        2,
        4,
        8,
        16,
        32,
        2**31,
        10**30,
        1.5,
        math.inf,
        "auto",
        "off",
        "full",
        "",
        "x.json",
    ]

    def value(depth: int = 0) -> Any:
        roll = rng.random()
        if depth < 2 and roll < 0.15:
            return [value(depth + 1) for _ in range(int(rng.integers(0, 4)))]
        if depth < 2 and roll < 0.25:
            return {str(rng.integers(0, 99)): value(depth + 1) for _ in range(int(rng.integers(0, 3)))}
        return scalars[int(rng.integers(0, len(scalars)))]

    keys = sorted({k for s in BASE.values() if isinstance(s, dict) for k in s} | {"mode", "on_error", "path", "slot"})
    sections = [*BASE, "padding", "report", "extra"]
    for _ in range(int(rng.integers(0, 4))):
        section = sections[int(rng.integers(0, len(sections)))]
        roll = rng.random()
        if roll < 0.1:
            doc[section] = value()
        elif roll < 0.2:
            doc.pop(section, None)
        elif isinstance(doc.setdefault(section, {}), dict):
            doc[section][keys[int(rng.integers(0, len(keys)))]] = value()
    text = yaml.safe_dump(doc)
    if rng.random() < 0.2:
        i = int(rng.integers(0, len(text)))
        text = text[:i] + ":[]{}&*!%@`|>-'\" \n#"[int(rng.integers(0, 19))] + text[i + 1 :]
    return text


def config_rows(scale: Scale, rng: np.random.Generator) -> list[Row]:
    rows = []
    fixtures = Tally()
    for path in sorted(ASSETS.glob("bad_*.yaml")):
        with fixtures.trial(path.name):
            try:
                load_config(path)
            except ConfigError as exc:
                if not all(p.key and p.message for p in exc.problems):
                    raise AssertionError(f"a problem without key or message: {exc}") from None
            else:
                raise AssertionError("loaded")
    rows.append(
        fixtures.row(
            "configs", "bad config fixtures (`tests/assets/bad_*.yaml`)", "refused with ConfigError naming the key"
        )
    )

    single = Tally()
    for dotted, value, what in field_edits() + CROSS_EDITS:
        with single.trial(f"{dotted} = {value!r} ({what})"):
            _expect_keys(_edited([(dotted, value, what)]), {dotted})
    rows.append(
        single.row(
            "configs",
            "generated bad configs, one mistake (every field x kind of mistake)",
            "refused with ConfigError naming the key and file:line",
        )
    )

    combos = Tally()
    pool = [e for e in field_edits() if not e[0].endswith("x") and not isinstance(e[1], list) and "." in e[0]]
    for _ in range(scale.combos):
        picked: dict[str, tuple] = {}
        for i in rng.permutation(len(pool))[: int(rng.integers(2, 5))]:
            picked.setdefault(pool[i][0], pool[i])
        with combos.trial(", ".join(f"{k}={v[1]!r}" for k, v in picked.items())):
            _expect_keys(_edited(list(picked.values())), set(picked))
    rows.append(
        combos.row("configs", "generated bad configs, 2-4 mistakes at once", "one ConfigError naming every key")
    )

    hostile = Tally()
    for name, text in HOSTILE_YAML.items():
        with hostile.trial(name):
            try:
                config_from_text(text, "hostile.yaml")
            except ConfigError:
                pass
            else:
                raise AssertionError("loaded")
    rows.append(
        hostile.row(
            "configs", "hostile YAML (deep nesting, alias bomb, tags, NUL, ...)", "refused with ConfigError, promptly"
        )
    )

    fuzz = Tally()
    loaded = 0
    for i in range(scale.random_docs):
        with fuzz.trial(f"document {i}"):
            try:
                config = config_from_text(random_document(rng), "fuzz.yaml")
            except ConfigError:
                continue
            loaded += 1
            assert_config_works(config)
    rows.append(
        fuzz.row(
            "configs",
            f"random YAML documents ({loaded} of them valid)",
            "ConfigError or a config that stages every dummy batch",
        )
    )
    return rows


# -- steps -------------------------------------------------------------------------------


def step_rows(scale: Scale, rng: np.random.Generator) -> list[Row]:
    config = make_config()
    manager = make_manager(config)
    manager.capture()
    catalogue = Tally()
    for hostile in hostile_batches(config):
        for run in (manager.execute, manager.eager):
            with catalogue.trial(f"{hostile.name} ({run.__name__})"):
                before = snapshot(manager)
                try:
                    run(StepBatch(*hostile.args))
                except REFUSALS as exc:
                    if not re.search(hostile.match, str(exc)):
                        raise AssertionError(f"message does not match {hostile.match!r}: {exc}") from None
                else:
                    raise AssertionError("accepted")
                assert_unchanged(manager, before)
    rows = [
        catalogue.row(
            "steps",
            "hostile catalogue (ids, lengths, blocks, counts, dtypes, shapes) x (execute, eager)",
            "refused naming field and index, buffers + KV cache + stats byte-identical",
        )
    ]

    valid, invalid = Tally(), Tally()
    lim = Limits.of(config)
    for i in range(scale.plans):
        plan = random_plan(rng, lim)
        tally = invalid if violations(plan, lim) else valid
        with tally.trial(f"plan {i}"):
            check_plan(manager, plan, lim)
    rows.append(
        valid.row(
            "steps",
            "fuzzed valid steps (by an oracle written apart from graphcap), any integer dtype",
            "accepted, graph (or eager fallback) == eager",
        )
    )
    rows.append(
        invalid.row(
            "steps",
            "fuzzed hostile steps (1-3 hostile edits, wrong dtypes and shapes)",
            "refused naming a broken field: BatchError with nothing written, or InvariantViolation "
            "with nothing read (KV cache and stats unchanged)",
        )
    )
    return rows


# -- silent wrong output or shape: per-request outputs, whole buffers, stored values, the null block --


def _mixed_batches(config, count: int, rng: np.random.Generator) -> Iterator[StepBatch]:
    """`count` real batches of random mixed keys of `config`, each with fewer requests than the key's rows."""
    keys = [key for key in KeyRegistry.from_config(config).planned if not key.uniform and key.num_reqs > 1]
    for i in range(count):
        key = keys[i % len(keys)]
        yield fill_batch(key, config, rng, int(rng.integers(1, key.num_reqs)))


def shape_rows(scale: Scale, rng: np.random.Generator) -> list[Row]:
    config = make_config()
    count = max(20, scale.plans // 10)
    steps = Tally()
    manager = CaptureManager(LastTokenLogits(config, DECLARED["dict"]), config, progress=False)
    manager.capture()
    for i, batch in enumerate(_mixed_batches(config, count, rng)):
        with steps.trial(f"step {i} ({batch.num_tokens} tokens, {batch.num_reqs} requests)"):
            check_output_rows(manager, batch)
    refused = Tally()
    for result in ("tensor", "tuple", "dict"):
        for wrong, verify in ((False, True), (True, True), (False, False)):
            with refused.trial(f"{result}, {'declared per token' if wrong else 'undeclared'}, verify {verify}"):
                check_wrong_cut_refused(make_config(capture__sizes=[8], checks__verify_replay=verify), result, wrong)
    whole = Tally()
    for shape in ((), (6,), (2, 3)):
        buffered = make_config(capture__sizes=[2, 4, 8])
        manager = CaptureManager(WholeBuffer(buffered, shape), buffered, progress=False, buffers=[whole_spec(shape)])
        with whole.trial(f"capture with a {shape} buffer"):
            if not all(record.verified for record in manager.capture().records):
                raise AssertionError("a key was not verified")
        for i, batch in enumerate(_mixed_batches(buffered, count // 3, rng)):
            with whole.trial(f"{shape} buffer, step {i}"):
                check_whole_buffer(manager, batch, rng)
    stored = Tally()
    for dtype, value in INF_WHEN_STORED:
        with stored.trial(f"{value!r} into {dtype}"):
            check_inf_refused(dtype, value)
    null = Tally()
    manager = make_manager(config)
    manager.capture()  # capture's own batches use the null block by design: they still verify
    for case in NULL_BLOCK_STEPS:
        with null.trial(case.name):
            check_null_block_refused(manager, case)
    return [
        steps.row(
            "outputs",
            "per-request outputs (`output_rows`: each request's last-token logits) over random steps at mixed keys, "
            "most with as many request rows as tokens",
            "execute == eager, num_reqs logits rows and num_tokens hidden rows",
        ),
        refused.row(
            "outputs",
            "per-request outputs undeclared or declared per token (tensor, tuple, dict) x verification on/off",
            "capture refused naming the output and the declaration to write, no graph left",
        ),
        whole.row(
            "engine buffers",
            "`none` buffers (scalar, (6,), (2, 3)): capture, then random steps with their own values",
            "verified with sampled values, the whole tensor at every key, execute == eager",
        ),
        stored.row(
            "engine buffers",
            "values a float buffer stores as inf (1e6, 70000.0, 65520.0, -1e5, 100000 in float16; 1e39 in float32)",
            "refused naming buffer, index and value, nothing written",
        ),
        null.row(
            "steps",
            "real steps reading or writing the null block (execute, eager); `block_table.set_row`/`append` of block 0",
            "refused naming the block-table entry, KV cache and stats unchanged",
        ),
    ]


# -- static inputs moved after capture, host values frozen at capture ---------------------

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
            torch.testing.assert_close(manager.execute(PROBE_STEP).clone(), manager.eager(PROBE_STEP))
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


# -- faults ------------------------------------------------------------------------------

FAULT_KINDS = [
    ("forward raises at one size", "error", "raise"),
    ("forward raises at one size", "error", "skip"),
    ("`torch.OutOfMemoryError` at the largest size", "oom", "raise"),
    ("`torch.OutOfMemoryError` at the largest size", "oom", "skip"),
    ("`KeyboardInterrupt` mid-capture", "interrupt", "raise"),
    ("`KeyboardInterrupt` mid-capture", "interrupt", "skip"),
]
PROBE = StepBatch([1, 2], [5, 3], [4, 5, 6], [[1, 2], [3, 0]])


def _fault_trial(manager, path: Path, kind: str, on_error: str, on_call: int, size: int, old: str | None) -> None:
    if old is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write(path, old)
    manager.model.arm(size, FAULTS[kind], on_call)
    failing = [k for k in manager.registry.capture_order() if k.num_tokens == size]
    if kind == "interrupt" or on_error == "raise":
        expected = KeyboardInterrupt if kind == "interrupt" else CaptureError
        try:
            manager.capture()
        except expected as exc:
            if expected is CaptureError:
                message = str(exc)
                if not message.startswith(f"capturing {failing[0]} failed"):
                    raise AssertionError(f"does not name {failing[0]}: {message}") from None
                if kind == "oom" and "capture.on_error: skip" not in message:
                    raise AssertionError(f"no memory hint: {message}") from None
        else:
            raise AssertionError(f"no {expected.__name__}")
        assert_nothing_left(manager)
        if (path.read_text() if path.exists() else None) != old or leftover_temp_files(path):
            raise AssertionError("the report on disk changed or a temporary file remains")
    else:
        report = manager.capture()
        if {r.key for r in report.skipped} != set(failing) or set(manager.graphs) & set(failing):
            raise AssertionError(
                f"skipped {[str(r.key) for r in report.skipped]}, expected {[str(k) for k in failing]}"
            )
        want = "out of memory" if kind == "oom" else "injected fault"
        if not all(want in r.reason for r in report.skipped):
            raise AssertionError(f"reason lacks {want!r}: {report.skipped[0].reason}")
        if manager.backend.memory_in_use() != sum(g.memory_bytes for g in manager.graphs.values()):
            raise AssertionError("memory held beyond the captured graphs")
        if json.loads(path.read_text())["num_skipped"] != len(failing):
            raise AssertionError("the report on disk is not this pass's")
        torch.testing.assert_close(manager.execute(PROBE).clone(), manager.eager(PROBE))
    manager.model.disarm()  # and the manager captures again, fully
    report = manager.capture()
    if len(report.captured) != len(manager.registry.planned):
        raise AssertionError("the manager could not capture again")
    torch.testing.assert_close(manager.execute(PROBE).clone(), manager.eager(PROBE))


def fault_rows(scale: Scale, workdir: Path) -> list[Row]:
    rows = []
    for what, kind, on_error in FAULT_KINDS:
        path = workdir / f"{kind}-{on_error}.json"
        config = make_config(FAULT_SIZES, capture__on_error=on_error, report__path=str(path))
        manager = make_manager(config, faulty=True)
        tally = Tally()
        for trial in range(scale.faults):
            on_call = 1 + trial % 4  # preflight, warmup, capture, verify
            size = 4 if kind == "oom" else (2, 4)[(trial // 4) % 2]
            old = OLD_REPORT if trial % 2 == 0 else None
            with tally.trial(f"{kind} {on_error} call {on_call} size {size}"):
                _fault_trial(manager, path, kind, on_error, on_call, size, old)
        if on_error == "skip" and kind != "interrupt":
            outcome = "size recorded as skipped with its reason, rest captured, step correct, captured again"
        elif kind == "interrupt":
            outcome = "propagated; GC restored, no graph or memory left, report unchanged, captured again"
        else:
            outcome = "CaptureError naming the key (+ hint); nothing left, report unchanged, captured again"
        rows.append(tally.row("faults", f"{what}, `on_error: {on_error}` (preflight/warmup/capture/verify)", outcome))

    tally = Tally()
    for trial in range(scale.report_writes):
        path = workdir / f"write-{trial}.yaml"
        atomic_write(path, OLD_REPORT)
        manager = make_manager(make_config(FAULT_SIZES, report__path=str(path)))
        exc_type = (KeyboardInterrupt, OSError)[trial % 2]
        expected = KeyboardInterrupt if exc_type is KeyboardInterrupt else CaptureError
        with tally.trial(f"{exc_type.__name__} in fsync"):
            fsync = os.fsync

            def fail(fd, exc_type=exc_type):
                raise exc_type("injected")

            os.fsync = fail
            try:
                manager.capture()
            except expected:
                pass
            else:
                raise AssertionError("the write did not fail")
            finally:
                os.fsync = fsync
            assert_nothing_left(manager)  # the pass is undone, not left half-done
            if path.read_text() != OLD_REPORT or leftover_temp_files(path):
                raise AssertionError("the old report changed or a temporary file remains")
            manager.capture()
            if yaml.safe_load(path.read_text())["num_graphs"] != len(manager.registry.planned):
                raise AssertionError("the next write is wrong")
    rows.append(
        tally.row(
            "faults",
            "report write fails after the pass (`KeyboardInterrupt` / `OSError` before the rename)",
            "pass undone (no graph left), old report whole, no temporary file, next write complete",
        )
    )
    return rows


# -- stress and threads ------------------------------------------------------------------


def stress_rows(scale: Scale) -> list[Row]:
    rows = []
    piecewise = {"capture.mode": "full_and_piecewise", "model.attention": "per_request", "model.num_layers": 2}
    cases = (
        ("decode (q=1)", {}, 1),
        ("speculative decode (q=4)", SPEC, 4),
        ("full_and_piecewise, per-request .item() attention", piecewise, 1),
    )
    for name, overrides, q in cases:
        manager = make_manager(make_config({"checks.poison_padding": True, **overrides}))
        manager.capture()
        tally = Tally()
        done = dict.fromkeys(("steps", "rows", "uniform", "mixed", "eager", "piecewise"), 0)
        for seed in range(scale.stress_seeds):
            manager.model.reset_kv_cache()
            with tally.trial(f"{name} seed {seed}"):
                result = stress(manager, scale.stress_steps, seed, spec_len=q)
                for field, value in zip(
                    done,
                    (
                        result.steps,
                        result.real_rows,
                        result.uniform_steps,
                        result.mixed_steps,
                        result.eager_steps,
                        result.piecewise_steps,
                    ),
                ):
                    done[field] += value
        total = scale.stress_seeds * scale.stress_steps
        detail = (
            f"{done['uniform']} uniform and {done['mixed']} mixed replays"
            + (f" ({done['piecewise']} piecewise)" if done["piecewise"] else "")
            + f", {done['eager']} eager; "
            f"{done['rows']} real rows"
        )
        what = f"poisoned random streams, {name}: {scale.stress_seeds} streams x {scale.stress_steps} steps"
        outcome = f"graph == eager on every real row: {done['steps']}/{total} steps ({detail})"
        rows.append(Row("stale data", what, total, outcome, done["steps"], tally.failures[:5]))
    return rows


def thread_rows(scale: Scale) -> list[Row]:
    manager = make_manager(make_config())
    manager.capture()
    expected = expected_outputs(manager)
    tally = Tally()
    for round_ in range(scale.thread_rounds):
        recapture = round_ % 4 == 3
        with tally.trial(f"round {round_}"):
            with EventLog(manager) as events:
                mismatches, errors = run_threads(
                    manager, expected, seed=round_, extra=manager.capture if recapture else None
                )
            if errors or mismatches or (not recapture and events.interleavings()):
                raise AssertionError(
                    f"{len(errors)} errors, {mismatches} wrong outputs, {events.interleavings()} interleavings"
                )
    rows = [
        tally.row(
            "threads",
            f"3 threads x 40 `execute` steps, {scale.thread_rounds} rounds "
            "(every 4th with a recapture in a 4th thread)",
            "no interleaving, outputs bit-exact",
        )
    ]
    control = Tally()
    lock = manager._lock
    for round_ in range(scale.control_rounds):
        manager._lock = NoLock()
        with control.trial(f"control {round_}"):
            with EventLog(manager) as events:
                mismatches, errors = run_threads(manager, expected, seed=100 + round_)
            if not (events.interleavings() or mismatches or errors):
                raise AssertionError("nothing detected without the lock")
        manager._lock = lock
    rows.append(
        control.row(
            "threads", "control: the same rounds with the lock removed", "interleaving or wrong output detected"
        )
    )
    return rows


# -- the command line and data-parallel configs ------------------------------------------

CLI_AREAS = {
    "files": (
        "config files: missing, unreadable (ELOOP, ENOTDIR, ENAMETOOLONG, EISDIR, EIO, EACCES), endless or huge "
        "(`/dev/zero`, 3 MB, 20 MB, 350k nodes), not UTF-8, 5000-digit integers; a bundled config by name, a "
        "factory module beside its config run from another directory"
    ),
    "flags": (
        "flags and values: `--set` long integers and quotes, sizes that cannot run, a failing model build or "
        "factory, `sizes --max-size 10**9`, bad histograms, stdout on a full disk or closed (`>&-`), "
        "`verify --seed -1`, `--device cuda:<huge>`, `--backend cuda` without CUDA, every key skipped"
    ),
    "reports": (
        "reports and plots: `--report` onto the config, file modes, a failed write, what a report records, "
        "a report path over a file graphcap did not write (a CI workflow), a config's report path outside its "
        "directory and the working directory, a path too long, `--plot` into a directory or with a suffix "
        "matplotlib cannot write, a PDF plot"
    ),
    "memory": (
        "memory: an 8B-shaped config with a huge cache on the CPU, a T x 2**40 float64 engine buffer, the "
        "estimate in `capture` and `sizes`"
    ),
    "packaging": "names: a factory override on the embedded default, vLLM mode spellings",
}


def cli_rows(scale: Scale, workdir: Path) -> list[Row]:
    rows = []
    for area, what in CLI_AREAS.items():
        cases = [c for c in CLI_CASES if c.area == area][: scale.cli_cases_per_area]
        tally, skipped = Tally(), []
        for i, case in enumerate(cases):
            reason = case.skip() if case.skip is not None else None
            if reason:
                skipped.append(f"{case.name}: {reason}")
                continue
            with tally.trial(case.name):
                check_case(case, workdir / f"cli-{area}-{i}")
        note = f" (not run on this machine: {'; '.join(skipped)})" if skipped else ""
        outcome = "the documented exit code, one line naming the file, key or flag, no traceback"
        rows.append(tally.row("command line", what + note, outcome))
    tally = Tally()
    for i in range(scale.interrupts):
        stage = STAGES[i % len(STAGES)]  # sent when the process logs the stage, never after a sleep
        with tally.trial(f"Ctrl-C at {stage}"):
            code, err = interrupt_at(stage, workdir / f"interrupt-{i}")
            if not interrupted_cleanly(code, err):
                raise AssertionError(f"exit {code}: {err.strip()[-300:]!r}")
    rows.append(
        tally.row(
            "command line",
            f"Ctrl-C at each of the {len(STAGES)} stages of `python -m graphcap verify` "
            f"({', '.join(STAGES)}; {scale.interrupts} trials), sent when the process logs the stage",
            "one line, no traceback, the process ends by SIGINT (a shell sees 130)",
        )
    )
    return rows


def dp_config_rows(scale: Scale, workdir: Path) -> list[Row]:
    tally = Tally()
    for world_size in scale.dp_worlds:
        with tally.trial(f"{world_size} ranks"):
            directory = workdir / f"dp-{world_size}"
            directory.mkdir()
            for result in mismatched_world(world_size, directory):
                if result.get("error") or result.get("keys") != ["capture.max_size", "capture.sizes"]:
                    raise AssertionError(f"rank {result['rank']}: {result}")
    return [
        tally.row(
            "configs",
            f"data-parallel ranks with different configs (gloo, {' and '.join(map(str, scale.dp_worlds))} ranks)",
            "every rank refuses at construction, naming each differing key with every rank's value",
        )
    ]


# -- lifecycle ---------------------------------------------------------------------------


def lifecycle_rows(scale: Scale) -> list[Row]:
    """The mini engine's whole life against a run without it; release/capture and resize_kv cycles."""
    import mini_engine  # tools/: the engine the README describes

    engine = Tally()
    for seed in range(scale.lifecycle_seeds):
        with engine.trial(f"seed {seed}"):
            plain = mini_engine.run(scale.lifecycle_steps, seed)
            lived = mini_engine.run(scale.lifecycle_steps, seed, lifecycle=True)
            if lived.digest != plain.digest:
                raise AssertionError(f"token streams differ: {lived.digest} != {plain.digest}")
            stats = lived.manager.stats
            if (len(lived.engine.refused), stats.captures, stats.eager["released"]) != (1, 5, 3):
                raise AssertionError(f"lifecycle not run as planned: {lived.events}")
    cycles, resized = Tally(), Tally()
    manager = make_manager(make_config())
    packed = manager.buffers.storage()["packed"].data_ptr()
    for cycle in range(scale.lifecycle_cycles):
        with cycles.trial(f"release cycle {cycle}"):
            manager.capture()
            released = manager.release()
            if released != len(manager.registry.planned) or manager.backend.memory_in_use() or manager.graphs:
                raise AssertionError(f"released {released}; {manager.backend.memory_in_use()} bytes left")
            asleep = manager.execute(PROBE_STEP).clone()
            report = manager.capture()
            if report.recapture["after"] != "release()" or manager.buffers.storage()["packed"].data_ptr() != packed:
                raise AssertionError(f"not a re-capture on the same buffers: {report.recapture}")
            torch.testing.assert_close(manager.execute(PROBE_STEP).clone(), asleep)
    manager = make_manager(make_config())
    manager.capture()
    grown = 72 + 24 * (1 + np.arange(scale.lifecycle_cycles))
    for cycle, num_blocks in enumerate(grown.tolist()):
        with resized.trial(f"resize cycle {cycle}"):
            manager.model.resize_kv_cache(num_blocks)
            manager.resize_kv(num_blocks)
            manager.block_table.set_row(0, [num_blocks - 1, num_blocks - 2])
            step = StepBatch([2], [6], [3, 4], manager.block_table)
            eager = manager.execute(step).clone()
            manager.capture(scratch_blocks=range(1, 40))
            torch.testing.assert_close(manager.execute(step).clone(), eager)
            try:
                manager.resize_kv(num_blocks - 1)
            except BatchError as exc:
                if f"holds block {num_blocks - 1}" not in str(exc) or not manager.graphs:
                    raise AssertionError(f"refused without naming the block, or changed: {exc}") from None
            else:
                raise AssertionError("shrank past a live block")
            manager.block_table.clear(0)
    return [
        engine.row(
            "lifecycle",
            f"mini engine (hybrid: 2 KV groups) with a weight swap, a re-capture, release and wake, the KV cache "
            f"grown with resize_kv: {scale.lifecycle_seeds} seeds x {scale.lifecycle_steps} steps",
            "every step graph == eager == dense, token streams identical to a run without any of it",
        ),
        cycles.row(
            "lifecycle",
            "release() then capture() cycles on one manager, a step between",
            "every graph and its memory freed, the step eager and equal, capture serves again on the same buffers",
        ),
        resized.row(
            "lifecycle",
            "resize_kv cycles: the cache grown, steps on the new blocks, captured again, a shrink past a live block",
            "graph == eager on the new blocks; the shrink refused naming the block, nothing changed",
        ),
    ]


def checks_rows(scale: Scale) -> list[Row]:
    """Lazy capture across a changed static input, scratch blocks a live row holds, sampled steps."""
    import _checks_rows  # tools/: the experiments, beside this campaign

    return _checks_rows.checks_rows(scale, Tally)


# -- report ------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu}); Python "
        f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} thread), "
        f"numpy {np.__version__}"
    )


def render(rows: list[Row], command: str, seconds: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Reliability",
        "",
        "Generated by `tools/reliability.py`; do not edit by hand. What each experiment checks is",
        "described in `tests/reliability/` (the same checks, fewer repetitions, run by the test suite).",
        "",
        f"- date: {now}",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        f"- wall time: {seconds:.0f} s; backend: emulated (CPU); "
        f"all checks {'passed' if all(r.ok for r in rows) else 'DID NOT pass'}",
        "",
        "| area | what was tried | count | outcome |",
        "|---|---|---:|---|",
    ]
    lines += [f"| {r.area} | {r.what} | {r.count} | {r.outcome} |" for r in rows]
    lines += [
        "",
        "## How to read it",
        "",
        "- configs: every refusal is one `ConfigError` listing each problem with its dotted key;",
        "  generated configs check that the edited key is named (with `file:line`), all of them at once",
        "  for several mistakes. A random document either fails that way or loads, and then stages a",
        "  dummy batch for every planned key with full invariants.",
        "- steps: a refused step leaves the persistent buffers, the KV cache and the step counters",
        "  byte-identical; an accepted one matches an eager run of the same step. Validity is decided",
        "  by an oracle in `graphcap/testing/fuzz.py` written without graphcap's code.",
        "- faults: injected by a model wrapper that raises during one phase (the checked preflight, a",
        "  warmup, capture, or the eager run of the replay check) of the keys of one size; after each, the",
        "  fault is disarmed and the same manager must capture every key again.",
        "- stale data: `checks.poison_padding: true` fills the whole packed staging buffer with a",
        "  sentinel before every step, so a read of a padded row the pad rules did not write is garbage.",
        "- threads: steps are self-contained, so every output is compared bit for bit with a",
        "  single-threaded run; staging and replay (or the eager forward) are logged per thread.",
        "- command line: the cases of `graphcap/testing/cli_cases.py` (also run once each by",
        "  `tests/cli/test_hostile.py`), each with its files, flags, expected exit code and message;",
        "  a case also fails on any traceback or on more than one error line. Ctrl-C is sent to a real",
        "  process at evenly spaced moments from start-up to capture.",
        "- outputs, engine buffers, null block: the checks of `graphcap/testing/outputs.py` (also run by",
        "  `tests/reliability/test_outputs_and_buffers.py`). A per-request output is a forward's",
        "  `logits[query_start_loc[1:] - 1]`, the rows engines sample.",
        "- lifecycle: `tools/mini_engine.py --lifecycle` against the same seed without it (the digest of",
        "  every token stream); release and resize cycles on the test configuration, each step compared",
        "  with an eager run.",
    ]
    failed = [r for r in rows if not r.ok]
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            lines += [f"- {r.what}:"] + [f"  - {f}" for f in r.failures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python tools/reliability.py --quick --out /tmp/RELIABILITY.md",
    )
    parser.add_argument("--quick", action="store_true", help="a few of each, to see that it runs")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "RELIABILITY.md", help="where to write the table")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random configs and steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("graphcap").setLevel(logging.ERROR)  # skipped keys are expected here
    scale = QUICK if args.quick else FULL
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="graphcap-reliability-") as workdir:
        sections: list[tuple[str, Callable[[], list[Row]]]] = [
            ("configs", lambda: config_rows(scale, rng)),
            ("data-parallel configs", lambda: dp_config_rows(scale, Path(workdir))),
            ("steps", lambda: step_rows(scale, rng)),
            ("faults", lambda: fault_rows(scale, Path(workdir))),
            ("stale data", lambda: stress_rows(scale)),
            ("threads", lambda: thread_rows(scale)),
            ("moved inputs", lambda: moved_rows(scale)),
            ("command line", lambda: cli_rows(scale, Path(workdir))),
            ("outputs and engine buffers", lambda: shape_rows(scale, rng)),
            ("lifecycle", lambda: lifecycle_rows(scale)),
            ("checks", lambda: checks_rows(scale)),
        ]
        for name, run in sections:
            t0 = time.perf_counter()
            rows += run()
            log(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    flags = " --quick" if args.quick else ""
    flags += f" --seed {args.seed}" if args.seed else ""
    command = f"python tools/reliability.py{flags}"
    text = render(rows, command, time.perf_counter() - start)
    atomic_write(args.out, text)
    print(text[text.index("| area") : text.index("\n## How")])
    log(f"wrote {args.out}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
