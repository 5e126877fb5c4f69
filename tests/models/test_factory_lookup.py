"""Where a `model.factory` module is found: `sys.path`, then beside the config file, then the
current directory; a module found nowhere names every place it was looked for."""

from __future__ import annotations

import sys

import pytest
import yaml

from graphcap import ConfigError, load_config
from graphcap.models import build_model, load_factory

TINY = {
    "device": "cpu",
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 128},
    "batching": {"max_num_seqs": 4, "max_num_tokens": 16},
    "kv_cache": {"block_size": 4, "num_blocks": 40, "max_model_len": 32},
    "capture": {"sizes": [2, 4]},
}
FACTORY = """
from dataclasses import replace
from graphcap.models import build_model
import {sibling}  # a sibling module of the factory, imported while the factory runs


def make(config):
    return build_model(replace(config, model=replace(config.model, factory=None, name="tiny-llama")))
"""


def _project(tmp_path, name):
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{name}.py").write_text(FACTORY.format(sibling=f"{name}_sibling"))
    (project / f"{name}_sibling.py").write_text("")
    doc = {**TINY, "model": {**TINY["model"], "factory": f"{name}:make"}}
    (project / "my.yaml").write_text(yaml.safe_dump(doc))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return project, elsewhere


def test_a_factory_beside_its_config_is_found_from_another_directory(tmp_path, monkeypatch):
    project, elsewhere = _project(tmp_path, "beside_model")
    monkeypatch.chdir(elsewhere)
    path_before = list(sys.path)
    config = load_config(project / "my.yaml")
    model = build_model(config)
    assert type(model).__name__ == "TinyLlama"
    assert sys.path == path_before  # searched for the import only


def test_a_missing_factory_module_names_every_place_it_looked(tmp_path, monkeypatch):
    project, elsewhere = _project(tmp_path, "unused_model")
    monkeypatch.chdir(elsewhere)
    config = load_config(project / "my.yaml", {"model.factory": "no_such_model:make"})
    with pytest.raises(
        ConfigError,
        match=(
            rf"cannot import module 'no_such_model' .*: ModuleNotFoundError: No module named 'no_such_model'; "
            rf"looked on sys.path, then in {project} \(beside the config file\) and in {elsewhere} "
            r"\(the current directory\)"
        ),
    ):
        build_model(config)
    with pytest.raises(ConfigError, match=rf"looked on sys.path, then in {elsewhere} \(the current directory\):"):
        load_factory("no_such_model:make")  # no config file: the current directory only
