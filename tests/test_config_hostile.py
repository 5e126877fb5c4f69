"""Hostile or careless config files and values: refused quickly, with the file, the key and the reason."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from graphcap.config import MAX_CONFIG_BYTES, ConfigError, _load, _yaml, config_from_text, load_config
from graphcap.config._yaml import MAX_NODES, YamlSyntaxError, parse_scalar
from graphcap.errors import ConfigProblem

# -- files the OS will not read ----------------------------------------------------------


def _symlink_loop(tmp_path: Path) -> Path:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


def _not_a_directory(tmp_path: Path) -> Path:
    (tmp_path / "file.yaml").write_text("device: cpu\n")
    return tmp_path / "file.yaml" / "config.yaml"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_symlink_loop, "ELOOP"),
        (_not_a_directory, "ENOTDIR"),
        (lambda tmp: tmp / ("x" * 300 + ".yaml"), "ENAMETOOLONG"),
        (lambda tmp: tmp, "EISDIR"),
        (lambda tmp: Path("/proc/self/mem"), "EIO"),  # opens, then every read at offset 0 fails
    ],
    ids=["symlink-loop", "not-a-directory", "name-too-long", "directory", "eio"],
)
def test_unreadable_config_is_a_config_error_naming_file_and_os_reason(tmp_path, make, reason):
    path = make(tmp_path)
    if not path.parent.exists() and reason != "ENOTDIR":
        pytest.skip(f"{path.parent} does not exist here")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.key == "<file>"
    assert problem.message.startswith(f"cannot read {path}: ") and f"({reason})" in problem.message
    assert info.value.source == str(path)


def test_permission_denied_is_a_config_error(tmp_path, monkeypatch):
    path = tmp_path / "secret.yaml"
    path.write_text("device: cpu\n")
    if os.geteuid() != 0:
        path.chmod(0)
    else:  # root reads anything: make open() fail the way it fails for everyone else

        def denied(*args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

        monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(ConfigError, match=rf"cannot read {path}: Permission denied \(EACCES\)"):
        load_config(path)


def test_missing_file_is_a_config_error_and_stays_file_not_found():
    with pytest.raises(FileNotFoundError, match=r"<file>: config file not found: /no/such\.yaml") as info:
        load_config("/no/such.yaml")
    assert isinstance(info.value, ConfigError) and info.value.errno == errno.ENOENT
    assert [p.key for p in info.value.problems] == ["<file>"]


# -- files too big, endless, or not text -------------------------------------------------


def _counting_open(monkeypatch) -> list[int]:
    """Record how many bytes `load_config` reads from any file (the loader's own `open`)."""
    read: list[int] = []

    def counting(path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)  # noqa: SIM115 (the loader closes it)
        real_read = handle.read

        def counted(size=-1):
            data = real_read(size)
            read.append(len(data))
            return data

        handle.read = counted
        return handle

    monkeypatch.setattr(_load, "open", counting, raising=False)
    return read


def test_endless_device_file_is_refused_after_reading_one_mebibyte(monkeypatch):
    read = _counting_open(monkeypatch)
    with pytest.raises(ConfigError, match=r"/dev/zero is larger than 1 MiB; a config is a few KiB"):
        load_config("/dev/zero")
    assert sum(read) == MAX_CONFIG_BYTES + 1


def _never_parsed(monkeypatch) -> None:
    def parse(*args, **kwargs):
        raise AssertionError("the text was parsed")

    monkeypatch.setattr(_load, "read_yaml", parse)


@pytest.mark.parametrize(
    "text",
    [
        "# " + "x" * 78 + "\n",  # a comment-only file (20 MB was accepted after 39 s)
        "- 1\n",  # a long list (3 MB took 86 s to refuse)
    ],
    ids=["comments", "list"],
)
def test_file_above_the_size_cap_is_refused_before_parsing(tmp_path, monkeypatch, text):
    path = tmp_path / "big.yaml"
    path.write_text(text * (MAX_CONFIG_BYTES // len(text) + 1))
    read = _counting_open(monkeypatch)
    _never_parsed(monkeypatch)
    with pytest.raises(ConfigError, match="is larger than 1 MiB"):
        load_config(path)
    assert sum(read) == MAX_CONFIG_BYTES + 1


def test_text_in_memory_above_the_size_cap_is_refused(monkeypatch):
    _never_parsed(monkeypatch)
    with pytest.raises(ConfigError, match=r"the text has \d+ characters, above 1048576"):
        config_from_text("#" * (MAX_CONFIG_BYTES + 1))


def test_node_count_is_bounded_while_composing(monkeypatch):
    # Just under 1 MiB: a flow list of ~350,000 integers. Refused at MAX_NODES, not after composing.
    text = "capture: {sizes: [" + "1, " * ((MAX_CONFIG_BYTES - 40) // 3) + "1]}\n"
    composed = []
    real = _yaml._Loader.compose_node

    def counted(self, parent, index):
        composed.append(1)
        return real(self, parent, index)

    monkeypatch.setattr(_yaml._Loader, "compose_node", counted)
    with pytest.raises(ConfigError, match=rf"more than {MAX_NODES} values; a config holds a few dozen"):
        config_from_text(text, "long.yaml")
    assert len(composed) == MAX_NODES + 1  # the node past the bound is refused, not built


def test_non_utf8_file_names_the_byte_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"device: cpu\nmodel: {name: caf\xe9}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        ConfigProblem("<file>", f"{path} is not UTF-8 text: byte 0xe9 at offset 29", f"{path}:2")
    ]


# -- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["9" * 5000, "-" + "9" * 101, "0x" + "f" * 5000])
def test_integer_too_long_names_the_key_and_line(literal):
    with pytest.raises(ConfigError) as info:
        config_from_text(f"device: cpu\nmodel:\n  seed: {literal}\n", "long.yaml")
    (problem,) = info.value.problems
    assert (problem.key, problem.where) == ("model.seed", "long.yaml:3")
    assert problem.message.startswith("integer too long (")


def test_integer_below_the_digit_limit_gets_the_range_message():
    with pytest.raises(ConfigError, match=r"model\.seed: must be <= 18446744073709551615"):
        config_from_text("model: {seed: 18446744073709551616}")


@pytest.mark.parametrize(
    ("text", "value"),
    [('"tiny-llama"', "tiny-llama"), ("'x y'", "x y"), ('"8"', "8"), ("''", ""), ('"it\'s"', "it's")],
)
def test_quoted_scalars_lose_their_quotes_as_in_yaml(text, value):
    assert parse_scalar(text) == value


def test_unterminated_quote_is_a_yaml_error():
    with pytest.raises(YamlSyntaxError, match="not valid YAML"):
        parse_scalar('"tiny-llama')


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("model.seed", 2**64, "18446744073709551615"),
        ("model.hidden_size", 1 << 20, "65536"),
        ("model.num_layers", 5000, "1024"),
        ("model.intermediate_size", 1 << 21, "1048576"),
        ("model.vocab_size", 1 << 25, "16777216"),
        ("batching.max_num_tokens", 2**31 - 1, "16777216"),
        ("batching.max_num_seqs", 1 << 21, "1048576"),
        ("kv_cache.max_model_len", 1 << 25, "16777216"),
        ("kv_cache.block_size", 1 << 17, "65536"),
    ],
)
def test_sizes_that_cannot_run_are_refused_by_validation(key, value, bound):
    with pytest.raises(ConfigError, match=rf"{key}: must be <= {bound}; got {value}"):
        load_config(overrides={key: value})


@pytest.mark.parametrize(
    ("given", "mode"), [("FULL", "full"), ("Full_Decode_Only", "full_decode_only"), ("NONE", "none")]
)
def test_vllm_mode_spellings_are_accepted_case_insensitively(given, mode):
    assert load_config(overrides={"capture.mode": given}).capture.mode == mode


def test_unknown_mode_lists_graphcaps_modes_with_the_value_as_written():
    modes = r"none \| full \| full_decode_only \| piecewise \| full_and_piecewise"
    with pytest.raises(ConfigError, match=rf"capture\.mode: expected {modes}; got 'CASCADE'"):
        load_config(overrides={"capture.mode": "CASCADE"})
    assert load_config(overrides={"capture.mode": "PIECEWISE"}).capture.mode == "piecewise"


# -- overrides of the model ------------------------------------------------------------------


def test_factory_override_replaces_the_default_model_name():
    config = load_config(overrides={"model.factory": "pkg.mod:make"})
    assert (config.model.name, config.model.factory) == (None, "pkg.mod:make")


def test_name_override_replaces_a_factory_of_the_file(tmp_path):
    path = tmp_path / "factory.yaml"
    path.write_text("model: {factory: 'pkg.mod:make'}\n")
    config = load_config(path, {"model.name": "tiny-llama"})
    assert (config.model.name, config.model.factory) == ("tiny-llama", None)


def test_name_and_factory_in_one_file_are_still_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("model: {name: tiny-llama, factory: 'pkg.mod:make'}\n")
    with pytest.raises(ConfigError, match=r"give model\.name or model\.factory, not both"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"give model\.name or model\.factory, not both"):
        load_config(overrides={"model.name": "tiny-llama", "model.factory": "pkg.mod:make"})
