"""`graphcap.config`: the embedded default, strict YAML, overrides, every problem at once."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcap.config import (
    BatchingConfig,
    CaptureConfig,
    CaptureSectionConfig,
    ChecksConfig,
    ConfigError,
    KVCacheConfig,
    ModelConfig,
    PadRules,
    ReportConfig,
    bundled_configs,
    config_from_text,
    load_config,
)
from graphcap.sizing.sizes import default_capture_sizes
from tests.conftest import ASSETS

REPO = Path(__file__).resolve().parents[1]


def load_error(name: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(ASSETS / name)
    return info.value


# -- the embedded default -----------------------------------------------------------------


def test_embedded_default_loads_with_the_documented_values():
    config = load_config()
    assert config.model.name == "tiny-llama" and config.model.factory is None
    assert (config.model.hidden_size, config.model.num_heads, config.model.num_kv_heads) == (256, 8, 2)
    assert config.device == "auto"
    assert (config.batching.max_num_seqs, config.batching.max_num_tokens) == (32, 256)
    assert (config.kv_cache.block_size, config.kv_cache.num_blocks, config.kv_cache.max_model_len) == (16, 256, 512)
    assert config.capture.mode == "full" and config.capture.sizes == "auto" and config.capture.max_size == 64
    assert config.checks.invariants == "basic" and config.checks.verify_replay is True
    assert config.padding == PadRules()
    assert config.capture_sizes.sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


def test_one_default_yaml_in_the_repository():
    # .venv/ and build/ (the links of an `editable_mode=strict` install) are install outputs, not the repository.
    found = (p for p in REPO.glob("**/default.yaml") if not {".venv", "build"} & set(p.relative_to(REPO).parts))
    assert sorted(p.relative_to(REPO).as_posix() for p in found) == ["graphcap/configs/default.yaml"]


@pytest.mark.parametrize("name", ["default", "decode-only", "spec-decode", "llama3-8b-h200", "tiny-cpu-ci"])
def test_bundled_configs_load_by_name_equal_to_their_files(name):
    assert name in bundled_configs()
    path = REPO / "graphcap" / "configs" / f"{name}.yaml"
    assert load_config(name) == load_config(f"{name}.yaml") == load_config(path)
    assert load_config(path).source == str(path) and load_config(name).source is None


def test_a_file_wins_over_a_bundled_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-cpu-ci").write_text("capture:\n  max_size: 2\n")
    assert load_config("tiny-cpu-ci").capture.max_size == 2
    assert load_config("tiny-cpu-ci.yaml").capture.max_size == 8  # no such file here: the bundled one


def test_embedded_default_equals_the_dataclass_defaults():
    assert load_config() == CaptureConfig()


def test_empty_file_means_every_default(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == CaptureConfig()


def test_empty_section_means_its_defaults():
    assert config_from_text("capture:\nchecks: ~\n") == CaptureConfig()


def test_to_dict_round_trips_through_yaml():
    config = load_config(overrides={"capture.sizes": [1, 2, 8], "padding.query_len": 1, "padding.seq_len": 1})
    assert config_from_text(yaml.safe_dump(config.to_dict())) == config


def test_float_exponent_parses_as_a_float_under_yaml_1_2():
    config = load_config(ASSETS / "good_float_exponent.yaml")
    assert config.model.rms_norm_eps == 1e-5 and isinstance(config.model.rms_norm_eps, float)
    assert config.model.rope_theta == 5e5
    assert config.checks.invariants == "off"  # the choice, not YAML 1.1's False
    assert (config.checks.atol, config.checks.rtol) == (1e-4, 1.3e-6)


def test_integer_given_to_a_float_field_becomes_a_float():
    config = config_from_text("model:\n  rope_theta: 500000\n")
    assert config.model.rope_theta == 500000.0 and isinstance(config.model.rope_theta, float)


def test_explicit_sizes_list_becomes_a_tuple():
    assert config_from_text("capture:\n  sizes: [1, 4, 16]\n  max_size: 16\n").capture.sizes == (1, 4, 16)


# -- overrides ----------------------------------------------------------------------------


def test_overrides_apply_on_top_of_the_file():
    config = load_config(ASSETS / "good_float_exponent.yaml", {"capture.max_size": 16, "device": "cpu"})
    assert config.capture.max_size == 16 and config.device == "cpu"
    assert config.model.rms_norm_eps == 1e-5


def test_overrides_create_missing_sections():
    assert load_config(overrides={"report.path": "out.json"}).report.path == "out.json"


def test_bad_override_value_is_validated_and_marked_override():
    with pytest.raises(ConfigError, match=r"override: capture\.max_size: must be >= 1; got 0") as info:
        load_config(overrides={"capture.max_size": 0})
    assert [(p.key, p.where) for p in info.value.problems] == [("capture.max_size", "override")]


def test_override_of_an_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"override: capture\.max_szie: unknown key \(did you mean max_size\?\)"):
        load_config(overrides={"capture.max_szie": 16})


def test_override_that_is_not_a_dotted_key_is_refused():
    with pytest.raises(ConfigError, match=r"override: capture\.max\.size: not a config key"):
        load_config(overrides={"capture.max.size": 16})
    with pytest.raises(ConfigError, match=r"override: engine\.threads: not a config key"):
        load_config(overrides={"engine.threads": 4})


def test_override_crossing_sections_is_checked_against_the_file():
    with pytest.raises(ConfigError, match=r"capture\.max_size: 512 exceeds batching\.max_num_tokens 256"):
        load_config(overrides={"capture.max_size": 512})


# -- bad files: one problem each, with the dotted key and file:line ------------------------

BAD_FILES = [
    # (file, dotted key, line or None, what the message says)
    ("bad_unknown_top_level_key.yaml", "modle", 2, r"unknown key \(did you mean model\?\); valid keys: device, model"),
    ("bad_unknown_section_key.yaml", "capture.max_szie", 3, r"did you mean max_size\?\); valid keys in capture:"),
    ("bad_duplicate_key.yaml", "capture.max_size", 4, r"duplicate key \(first at line 2\)"),
    ("bad_root_not_mapping.yaml", "<root>", 1, r"the root must be a mapping of sections; got list"),
    ("bad_section_not_mapping.yaml", "capture", 1, r"must be a mapping of keys; got 64 \(int\)"),
    ("bad_wrong_type.yaml", "model.hidden_size", 2, r"expected an integer; got 'big' \(str\)"),
    ("bad_bool_in_int_field.yaml", "batching.max_num_seqs", 2, r"expected an integer; got True \(bool\)"),
    ("bad_yaml11_off_in_bool.yaml", "checks.verify_replay", 3, r"got 'off' \(str\) \(YAML 1\.1 reads 'off' as a boolean"),
    ("bad_quoted_number.yaml", "capture.max_size", 2, r"got '32' \(str\) \(a quoted number is a string: drop the quotes\)"),
    ("bad_out_of_range.yaml", "capture.num_warmups", 2, r"must be <= 100; got 101"),
    ("bad_sizes_not_ascending.yaml", "capture.sizes", 2, r"ascending and unique; got \[1, 8, 4\]"),
    ("bad_sizes_duplicate.yaml", "capture.sizes", 2, r"ascending and unique; got \[2, 4, 4\]"),
    ("bad_sizes_above_max_size.yaml", "capture.sizes", 3, r"largest size 32 exceeds capture\.max_size 16"),
    ("bad_max_size_above_max_num_tokens.yaml", "capture.max_size", 4, r"256 exceeds batching\.max_num_tokens 128"),
    ("bad_max_model_len_above_kv_cache.yaml", "kv_cache.max_model_len", 4, r"512 tokens do not fit the KV cache.*num_blocks to 33"),
    ("bad_num_heads_not_dividing_hidden_size.yaml", "model.num_heads", 3, r"hidden_size 256 is not divisible by num_heads 6"),
    ("bad_num_kv_heads_not_dividing_num_heads.yaml", "model.num_kv_heads", 3, r"num_heads 8 is not divisible by num_kv_heads 3"),
    ("bad_mode_literal.yaml", "capture.mode", 2, r"expected none \| full \| full_decode_only \| piecewise \| full_and_piecewise; got 'partial'"),
    ("bad_device.yaml", "device", 1, r"must be auto, cpu, cuda or cuda:N; got 'gpu'"),
    ("bad_atol_without_rtol.yaml", "checks.atol", 2, r"give checks\.atol and checks\.rtol together or neither"),
    ("bad_max_size_not_multiple_of_query_len.yaml", "capture.max_size", 2, r"30 is not a multiple of uniform_query_len 4; use 28 or 32"),
    ("bad_name_and_factory.yaml", "model.factory", 3, r"give model\.name or model\.factory, not both"),
    ("bad_factory_format.yaml", "model.factory", 2, r'must look like "pkg\.module:function"; got \'my_pkg\.models\.build\''),
    ("bad_padding_seq_len_below_query_len.yaml", "padding.seq_len", 3, r"1 is smaller than padding\.query_len 2"),
    ("bad_report_suffix.yaml", "report.path", 2, r"must end in \.json, \.yaml or \.yml; got 'capture-report\.txt'"),
    ("bad_yaml_syntax.yaml", "<yaml>", 3, r"not valid YAML"),
    ("bad_python_tag.yaml", "model", 1, r"tag tag:yaml\.org,2002:python/object/apply:os\.system is not allowed"),
]  # fmt: skip


def test_bad_fixtures_are_distinct_and_all_listed():
    names = [name for name, *_ in BAD_FILES]
    assert len(set(names)) == len(names) >= 15
    on_disk = {p.name for p in ASSETS.glob("bad_*.yaml")} - {"bad_many_problems.yaml"}
    assert on_disk == set(names)


@pytest.mark.parametrize(("name", "key", "line", "message"), BAD_FILES, ids=[b[0][4:-5] for b in BAD_FILES])
def test_bad_config_names_the_dotted_key_and_file_line(name, key, line, message):
    path = ASSETS / name
    error = load_error(name)
    assert len(error.problems) == 1, error
    problem = error.problems[0]
    assert problem.key == key
    assert problem.where == f"{path}:{line}"
    assert re.search(message, problem.message), problem.message
    # The one-line form a CLI prints: file:line, dotted key, message.
    assert f"{path}:{line}: {key}: " in str(error)
    assert str(error).startswith(f"1 problem in {path}:")


def test_multi_problem_file_reports_every_problem_in_one_error_in_file_order():
    path = ASSETS / "bad_many_problems.yaml"
    error = load_error("bad_many_problems.yaml")
    assert [(p.key, p.where) for p in error.problems] == [
        ("model.num_heads", f"{path}:4"),
        ("device", f"{path}:5"),
        ("batching.max_num_seqs", f"{path}:7"),
        ("capture.mode", f"{path}:10"),
        ("capture.warmups", f"{path}:12"),
        ("checks.verify_replay", f"{path}:14"),
    ]
    assert "did you mean num_warmups?" in error.problems[4].message
    assert "YAML 1.1 reads 'yes'" in error.problems[5].message
    assert str(error).startswith(f"6 problems in {path}:")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_missing_file_is_a_config_error_naming_the_bundled_configs(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"<file>: config file not found: .*nope\.yaml \(configs shipped with "
        r"graphcap, loadable by name: decode-only, default, llama3-8b-h200, spec-decode, tiny-cpu-ci\)",
    ):
        load_config(tmp_path / "nope.yaml")


def test_directory_instead_of_a_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"<file>: cannot read"):
        load_config(tmp_path)


def test_explicit_sizes_with_a_zero_name_the_entry():
    # Regression: used to say "max_num_tokens must be an integer >= 1; got 0".
    with pytest.raises(ConfigError, match=r"capture\.sizes: capture size \[0\] must be an integer >= 1; got 0"):
        config_from_text("capture:\n  sizes: [0]\n")


def test_huge_sizes_are_refused_before_any_table_is_built(monkeypatch):
    # Regression: a typo'd size of 1e30 raised OverflowError, and 1e9 tried to allocate a table.
    from graphcap.config import sections

    real = sections.CaptureSizes

    def build(sizes, max_num_tokens):
        if max(sizes) > 65536 or max_num_tokens > 1 << 24:
            raise AssertionError(f"a padding table for {max(sizes)} tokens was built")
        return real(sizes, max_num_tokens)

    monkeypatch.setattr(sections, "CaptureSizes", build)  # a failed section's defaults may still build theirs
    with pytest.raises(ConfigError, match=r"capture\.sizes: largest size 10{30} is above 65536"):
        config_from_text(f"capture:\n  sizes: [1, {10**30}]\n")
    with pytest.raises(ConfigError, match=r"capture\.sizes: largest size 10{30} exceeds capture\.max_size 64"):
        config_from_text(f"capture:\n  sizes: [1, {10**30}]\n  max_size: 64\n")
    with pytest.raises(ConfigError, match=r"capture\.max_size: must be <= 65536; got 1000000000"):
        config_from_text("batching:\n  max_num_tokens: 1000000000\ncapture:\n  max_size: 1000000000\n")


def test_full_decode_only_without_a_uniform_size_is_refused():
    text = "batching:\n  max_num_seqs: 2\ncapture:\n  mode: full_decode_only\n  sizes: [4, 8]\n  max_size: 8\n"
    with pytest.raises(ConfigError, match=r"capture\.mode: full_decode_only captures uniform keys only"):
        config_from_text(text)


# -- sections built directly validate themselves -------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: CaptureSectionConfig(max_size=0), r"capture\.max_size: must be >= 1; got 0"),
        (lambda: CaptureSectionConfig(sizes=[4, 2], max_size=8), r"capture\.sizes: capture sizes must be ascending"),
        (lambda: CaptureSectionConfig(mode="always"), r"capture\.mode: expected none \| full \| full_decode_only"),
        (lambda: ModelConfig(num_heads=6), r"model\.num_heads: hidden_size 256 is not divisible by num_heads 6"),
        (lambda: ModelConfig(name="gpt-9"), r"model\.name: unknown model 'gpt-9'; built in: tiny-llama"),
        (lambda: BatchingConfig(max_num_seqs=0), r"batching\.max_num_seqs: must be >= 1; got 0"),
        (lambda: KVCacheConfig(num_blocks=1), r"kv_cache\.num_blocks: must be >= 2; got 1"),
        (lambda: ChecksConfig(rtol=0.1), r"checks\.atol: give checks\.atol and checks\.rtol together"),
        (lambda: ChecksConfig(verify_replay="off"), r"checks\.verify_replay: expected true or false; got 'off'"),
        (lambda: ReportConfig(path="r.csv"), r"report\.path: must end in \.json, \.yaml or \.yml"),
        (lambda: PadRules(slot=0), r"padding\.slot: must be <= -1; got 0"),
        (lambda: PadRules(query_len=1), r"padding\.seq_len: 0 is smaller than padding\.query_len 1"),
        (lambda: CaptureConfig(device="gpu"), r"device: must be auto, cpu, cuda or cuda:N; got 'gpu'"),
        (
            lambda: CaptureConfig(capture=CaptureSectionConfig(max_size=512)),
            r"capture\.max_size: 512 exceeds batching\.max_num_tokens 256",
        ),
        (lambda: CaptureConfig(padding=PadRules(token_id=5000)), r"padding\.token_id: 5000 is not a valid token id"),
    ],
)
def test_sections_built_directly_raise_config_error_with_the_dotted_key(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CaptureSectionConfig().max_size = 8


def test_section_problems_are_all_reported_together():
    with pytest.raises(ConfigError) as info:
        CaptureSectionConfig(max_size=0, num_warmups=-1, mode="x")
    assert {p.key for p in info.value.problems} == {"capture.max_size", "capture.num_warmups", "capture.mode"}


# -- fuzz: whatever the YAML holds, only ConfigError escapes --------------------------------

_KEYS = [
    "model", "device", "batching", "kv_cache", "capture", "checks", "report", "padding",
    "name", "factory", "hidden_size", "num_heads", "num_kv_heads", "vocab_size", "dtype", "rms_norm_eps",
    "max_num_seqs", "max_num_tokens", "block_size", "num_blocks", "max_model_len", "mode", "sizes",
    "max_size", "num_warmups", "uniform_query_len", "on_error", "invariants", "verify_replay", "atol",
    "rtol", "path", "query_len", "seq_len", "slot", "position", "token_id", "block_id",
]  # fmt: skip
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 600)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["auto", "off", "yes", "full", "cpu", "cuda:1", "tiny-llama", "a.b:c", "1e-5", "x.json", ""])
    | st.text(max_size=8)
)
_keys = st.sampled_from(_KEYS) | st.text(max_size=6)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=5),
    max_leaves=12,
)
_sections = st.dictionaries(st.sampled_from(_KEYS[8:]) | _keys, _values, max_size=6)
_documents = st.dictionaries(st.sampled_from(_KEYS[:8]) | _keys, _sections | _values, max_size=8) | _values


@given(document=_documents)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_documents_load_or_raise_config_error_only(document):
    text = yaml.safe_dump(document)
    try:
        config = config_from_text(text)
    except ConfigError as exc:
        assert exc.problems and all(p.message for p in exc.problems)
    else:
        assert isinstance(config, CaptureConfig)


# -- capture.sizes and capture.max_size agree (vLLM refuses the same disagreement) ----------


def test_sizes_below_an_explicit_max_size_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"capture\.max_size: 8 is above the largest of capture\.sizes \[1, 2, 4\]"):
        config_from_text("capture:\n  sizes: [1, 2, 4]\n  max_size: 8\n")


def test_max_size_follows_an_explicit_size_list_when_not_given():
    config = config_from_text("capture:\n  sizes: [1, 2, 4]\n")
    assert config.capture.max_size == 4 and config.capture_sizes.max_size == 4
    assert load_config(overrides={"capture.sizes": [2, 8]}).capture.max_size == 8  # over the embedded default


def test_max_size_defaults_to_64_with_auto_sizes():
    assert config_from_text("capture:\n  sizes: auto\n").capture.max_size == 64


def test_capture_sizes_are_built_once_on_construction():
    config = load_config()
    assert config.capture_sizes is config.capture_sizes
    assert config.capture_sizes.sizes == tuple(default_capture_sizes(64))


def test_padding_seq_len_is_bounded_by_max_model_len():
    with pytest.raises(ConfigError, match=r"padding\.seq_len: 33 is above kv_cache\.max_model_len 32"):
        config_from_text("kv_cache:\n  max_model_len: 32\npadding:\n  seq_len: 33\n")
    assert config_from_text("kv_cache:\n  max_model_len: 32\npadding:\n  seq_len: 32\n").padding.seq_len == 32


def test_cross_section_problem_is_dropped_when_its_other_section_failed_on_its_own():
    # batching fails by itself; the root's comparison of capture.max_size with batching's
    # default would be noise, so only the real problem is reported.
    with pytest.raises(ConfigError) as info:
        config_from_text("batching:\n  max_num_tokens: 0\ncapture:\n  max_size: 512\n")
    assert [p.key for p in info.value.problems] == ["batching.max_num_tokens"]


def _config_with_report(directory: Path, report_path: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "c.yaml"
    path.write_text(f"device: cpu\nreport:\n  path: {report_path}\n")
    return path


def test_a_report_path_from_a_config_file_stays_under_its_directory_or_the_working_directory(tmp_path, monkeypatch):
    work, project, elsewhere = tmp_path / "work", tmp_path / "project", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "out").symlink_to(elsewhere)  # inside the working directory by name, outside once resolved
    monkeypatch.chdir(work)
    allowed = ["r.json", "reports/r.json", str(project / "sub" / "r.json"), str(work / "r.yaml")]
    refused = ["../r.json", "../../etc/r.json", str(elsewhere / "r.json"), "/proc/r.json", "out/r.json"]
    for report_path in allowed:
        assert load_config(_config_with_report(project, report_path)).report.path == report_path
    for report_path in refused:
        config = _config_with_report(project, report_path)
        with pytest.raises(
            ConfigError,
            match=r"c\.yaml:3: report\.path: .* resolves to .*, outside .*project or .*work; "
            r"a config may write its report only under its own directory or the working directory",
        ):
            load_config(config)
        # What the caller gives is the caller's choice: an override may point anywhere.
        assert load_config(config, {"report.path": report_path}).report.path == report_path


def test_a_report_path_in_text_stays_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_from_text("report:\n  path: r.json\n").report.path == "r.json"
    with pytest.raises(ConfigError, match=r"report\.path: \.\./r\.json resolves to .*, outside "):
        config_from_text("report:\n  path: ../r.json\n")


def test_the_source_of_a_config_is_kept_but_is_no_key(tmp_path):
    path = _config_with_report(tmp_path, "r.json")
    config = load_config(path)
    assert config.source == str(path) and config == load_config(overrides={"device": "cpu", "report.path": "r.json"})
    assert "source" not in config.to_dict()
    with pytest.raises(ConfigError, match=r"source: not a config key"):
        load_config(overrides={"source": "x.yaml"})
    with pytest.raises(ConfigError, match=r"source: unknown key"):
        config_from_text("source: x.yaml\n")


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:128", r"cuda:128 is not a device index torch can hold \(0\.\.127\)"),
        ("cuda:99999999999999999999", r"cuda:999999999\.\.\. is not a device index"),
        ("cuda:0127", r"cuda:0127 is not a device index"),
        ("tpu", r"must be auto, cpu, cuda or cuda:N; got 'tpu'"),
    ],
)
def test_a_device_index_torch_would_wrap_or_refuse_is_a_config_error(device, message):
    # torch.device("cuda:128") is cuda:-128 and "cuda:32768" is cuda:0: silently another device.
    with pytest.raises(ConfigError, match=rf"device: {message}"):
        load_config(overrides={"device": device})
    assert load_config(overrides={"device": "cuda:127"}).device == "cuda:127"


def test_a_bad_memory_budget_is_named_beside_another_fields_mistake():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"capture.memory_budget": "lots", "capture.mode": "bogus"})
    keys = {problem.key for problem in info.value.problems}
    assert {"capture.memory_budget", "capture.mode"} <= keys, keys
