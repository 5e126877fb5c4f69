"""Bad configs: fixtures, one generated mistake per field, several at once, hostile YAML,
random documents, and data-parallel ranks that load different configs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path
from typing import Any

import numpy as np
import yaml

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
from graphcap.testing import TINY, assert_config_works, nested

from .dp_agreement import mismatched_world
from .trials import Row, Scale, Tally

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "tests" / "assets"


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
