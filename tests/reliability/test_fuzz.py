"""Fuzzing: steps and YAML configs, valid and hostile. Only the documented exceptions escape
(`ValueError`/`InvariantViolation` for a step, `ConfigError` for a config) and every valid
input works. The `slow` versions run many more examples."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.config import ConfigError, config_from_text, load_config
from graphcap.testing import (
    BAD_FORMS,
    INT_FORMS,
    TINY,
    BatchPlan,
    Limits,
    assert_config_works,
    check_plan,
    make_config,
    make_manager,
    nested,
)

CONFIG = make_config()
LIMITS = Limits.of(CONFIG)
FIELDS = ("query_lens", "seq_lens", "input_ids", "block_table")
FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def manager():
    manager = make_manager(CONFIG)
    manager.capture()
    return manager


# -- steps -------------------------------------------------------------------------------

_absurd = st.integers(-(2**40), 2**40) | st.sampled_from(
    [-(2**31), -1, 0, 2**31 - 1, 2**31, 2**62, LIMITS.vocab_size, LIMITS.num_blocks, LIMITS.max_model_len + 1]
)


@st.composite
def batch_plans(draw) -> BatchPlan:
    """A valid step for CONFIG, then up to three hostile edits and maybe one non-integer field."""
    lim = LIMITS
    n = draw(st.integers(0, lim.max_num_seqs))
    if draw(st.booleans()):
        q = [1] * n  # decode: the uniform keys
    else:
        q = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    s = [v + draw(st.integers(0, lim.max_model_len - v)) for v in q]
    ids = draw(st.none() | st.lists(st.integers(0, lim.vocab_size - 1), min_size=sum(q), max_size=sum(q)))
    table = None
    if draw(st.booleans()):
        need = max((-(-v // lim.block_size) for v in s), default=0)
        width = draw(st.integers(need, lim.max_blocks_per_req))
        row = st.lists(st.integers(0, lim.num_blocks - 1), min_size=width, max_size=width)
        table = draw(st.lists(row, min_size=n, max_size=n))
    plan = BatchPlan(q, s, ids, table)
    for _ in range(draw(st.integers(0, 3))):
        _edit(draw, plan)
    bad = draw(st.none() | st.none() | st.sampled_from(FIELDS))
    plan.forms = {f: draw(st.sampled_from(BAD_FORMS if f == bad else INT_FORMS)) for f in FIELDS}
    return plan


def _edit(draw, plan: BatchPlan) -> None:
    lim = LIMITS
    target = draw(st.sampled_from([*FIELDS, "lengths", "width", "too_many"]))
    rows = {"query_lens": plan.query_lens, "seq_lens": plan.seq_lens, "input_ids": plan.input_ids}
    if rows.get(target):
        values = rows[target]
        values[draw(st.integers(0, len(values) - 1))] = draw(_absurd)
    elif target == "block_table" and plan.block_table and plan.block_table[0]:
        row = plan.block_table[draw(st.integers(0, len(plan.block_table) - 1))]
        row[draw(st.integers(0, len(row) - 1))] = draw(_absurd)
    elif target == "lengths":
        values = draw(st.sampled_from([plan.query_lens, plan.seq_lens, plan.input_ids or [], plan.block_table or []]))
        if values and draw(st.booleans()):
            values.pop()
        else:
            values.append([1] * len(values[0]) if values and isinstance(values[0], list) else 1)
    elif target == "width" and plan.block_table:
        grow = draw(st.booleans())
        plan.block_table = [[*r, *[1] * lim.max_blocks_per_req] if grow else r[:1] for r in plan.block_table]
    elif target == "too_many":
        extra = draw(st.sampled_from([lim.max_num_seqs + 1, 1]))
        each = lim.max_num_tokens // extra + 1
        plan.query_lens, plan.seq_lens = [each] * extra, [each] * extra
        plan.input_ids = plan.block_table = None


@FAST
@given(plan=batch_plans())
def test_fuzzed_steps_are_accepted_if_and_only_if_valid(manager, plan):
    check_plan(manager, plan, LIMITS)


@pytest.mark.slow
@LONG
@given(plan=batch_plans())
def test_fuzzed_steps_long(manager, plan):
    check_plan(manager, plan, LIMITS)


# -- configs -----------------------------------------------------------------------------


BASE = nested(TINY)
_SECTION_KEYS = {name: sorted(section) for name, section in BASE.items() if isinstance(section, dict)}
_KNOWN = sorted({k for keys in _SECTION_KEYS.values() for k in keys} | {"on_error", "mode", "path", "slot", "dtype"})
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 80)
    | st.sampled_from([-(2**31) - 1, -(2**31), 2**31 - 1, 2**31, 2**63, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["auto", "off", "yes", "on", "full", "none", "skip", "cpu", "cuda:7", "1e-5", "0x10", "x.json"])
    | st.text(max_size=6)
)
_values = st.recursive(
    _scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8
)


@st.composite
def yaml_documents(draw) -> str:
    """TINY as YAML with random edits (keys, types, nesting) and maybe a textual corruption."""
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.sampled_from([*_SECTION_KEYS, "padding", "report"]) | st.text(max_size=5))
        action = draw(st.sampled_from(["set", "set", "set", "drop", "replace"]))
        if action == "replace":
            doc[section] = draw(_values)
        elif action == "drop":
            doc.pop(section, None)
        else:
            target = doc.setdefault(section, {})
            if isinstance(target, dict):
                target[draw(st.sampled_from(_KNOWN) | st.text(max_size=5))] = draw(_values)
    if draw(st.integers(0, 9)) == 0:
        doc = draw(_values)  # the root itself is wrong
    text = yaml.safe_dump(doc)
    corruption = draw(st.sampled_from(["none"] * 6 + ["flip", "alias", "duplicate", "tab"]))
    if corruption == "flip" and text:
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + draw(st.sampled_from(list(":[]{}&*!%@`|>-\"' \n#\x00"))) + text[i + 1 :]
    elif corruption == "alias":
        text = "anchor: &a [1, 2]\nuse: [*a, *a]\n" + text
    elif corruption == "duplicate":
        first = text.splitlines(keepends=True)[:1]
        text = "".join(first) + text
    elif corruption == "tab":
        text = text.replace("  ", "\t", 1)
    return text


def _load_or_refuse(text: str) -> str:
    try:
        config = config_from_text(text, "fuzz.yaml")
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p.key, str) and p.message for p in exc.problems), exc
        return "refused"
    assert_config_works(config)
    return "loaded"


@FAST
@given(text=yaml_documents())
def test_fuzzed_yaml_configs_load_and_work_or_raise_config_error(text):
    _load_or_refuse(text)


@st.composite
def valid_overrides(draw) -> dict:
    """Configs valid by the documented rules: each must load and work."""
    q = draw(st.sampled_from([1, 2, 4]))
    seqs = draw(st.integers(1, 12))
    tokens = draw(st.integers(max(seqs, q), 48))
    block_size = draw(st.integers(1, 16))
    max_model_len = draw(st.integers(q, 64))
    num_blocks = draw(st.integers(-(-max_model_len // block_size) + 1, 80))
    mode = draw(st.sampled_from(["none", "full", "full_decode_only"]))
    top = min(tokens, seqs * max_model_len) if mode == "full" else tokens
    max_size = q * draw(st.integers(1, max(1, top // q)))
    sizes = "auto"
    if draw(st.booleans()):
        sizes = sorted({*draw(st.lists(st.integers(1, max_size), max_size=5)), q, max_size})
    query_len = draw(st.integers(0, min(2, max_model_len)))
    return {
        "batching.max_num_seqs": seqs,
        "batching.max_num_tokens": tokens,
        "kv_cache.block_size": block_size,
        "kv_cache.max_model_len": max_model_len,
        "kv_cache.num_blocks": num_blocks,
        "capture.mode": mode,
        "capture.uniform_query_len": q,
        "capture.max_size": max_size,
        "capture.sizes": sizes,
        "checks.invariants": draw(st.sampled_from(["off", "basic", "full"])),
        "padding.query_len": query_len,
        "padding.seq_len": draw(st.integers(query_len, min(query_len + 2, max_model_len))),
        "padding.position": draw(st.integers(0, max_model_len - 1)),
        "padding.token_id": draw(st.integers(0, TINY["model.vocab_size"] - 1)),
        "padding.block_id": draw(st.integers(0, num_blocks - 1)),
        "padding.slot": draw(st.integers(-5, -1)),
    }


@FAST
@given(overrides=valid_overrides())
def test_every_valid_config_loads_and_stages_every_dummy_batch(overrides):
    assert_config_works(make_config(overrides))


@pytest.mark.slow
@LONG
@given(text=yaml_documents())
def test_fuzzed_yaml_configs_long(text):
    _load_or_refuse(text)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(overrides=valid_overrides())
def test_valid_configs_capture_and_replay(overrides):
    manager = make_manager(make_config(overrides))
    manager.capture()  # verify_replay is on: each key replays once and is compared with eager
    assert len(manager.graphs) == len(manager.registry.planned)


# -- hostile configs (each once refused late, crashed or hung) ---------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("model: " + "[" * 3000 + "]" * 3000, "nested too deeply"),
        ("model: " + "{a: " * 3000 + "1" + "}" * 3000, "nested too deeply"),
        ("x: &a [*a]\n", "alias refers to its own anchor"),
        ("batching: {max_num_tokens: 100000000000000000000}", r"batching\.max_num_tokens: must be <= 16777216"),
        ("padding: {seq_len: 4294967296}", r"padding\.seq_len: must be <= 2147483647 \(the int32 range"),
        ("padding: {slot: -4294967296}", r"padding\.slot: must be >= -2147483648"),
        ("kv_cache: {block_size: 65536, num_blocks: 65536}", r"kv_cache\.num_blocks: .* slots exceed the int32 range"),
        ("checks: {atol: .inf, rtol: 1.0e-3}", r"checks\.atol: must be finite"),
        ("model: {rope_theta: 1.0e400}", r"model\.rope_theta: must be finite"),
        (
            "batching: {max_num_seqs: 2}\nkv_cache: {max_model_len: 1}\ncapture: {max_size: 4, sizes: [2, 4]}",
            r"capture\.sizes: size 4 can never be reached",
        ),
    ],
    ids=[
        "deep-list",
        "deep-map",
        "self-alias",
        "huge-tokens",
        "pad-seq-len",
        "pad-slot",
        "slots",
        "inf-atol",
        "inf-theta",
        "unreachable",
    ],
)
def test_hostile_config_is_refused_with_config_error(text, match):
    with pytest.raises(ConfigError, match=match):
        config_from_text(text)


def test_alias_bomb_is_refused_instead_of_expanded():
    """`billion laughs`: nine levels of ten aliases would build 10**9 values (hours, then
    out of memory); the value budget stops it after about 10**5."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(ConfigError, match="builds more than"):
        config_from_text("\n".join(lines))


def test_overrides_that_are_not_a_mapping_raise_type_error():
    with pytest.raises(TypeError, match="overrides must map dotted keys"):
        load_config(overrides=[("capture.max_size", 4)])
