"""`Parallel`: one options object for a manager's data- and tensor-parallel peers; the old keywords are refused.

Single process: no group is initialised, so nothing here agrees with a peer.
"""

from __future__ import annotations

import dataclasses

import pytest

from graphcap import CaptureManager, Parallel, load_config
from graphcap.models import build_model
from tests.configs import SMALL


@pytest.fixture(scope="module")
def config():
    return load_config(overrides={**SMALL, "model.num_layers": 1})


def test_an_unknown_keyword_is_refused_as_python_does(config):
    with pytest.raises(TypeError, match="unexpected keyword argument 'groups'"):
        CaptureManager(build_model(config), config, groups=None)


def test_group_is_the_shorthand_and_both_together_are_refused(config):
    with pytest.raises(TypeError, match=r"both group= and parallel=.*Parallel\(dp_group=\.\.\.\) only"):
        CaptureManager(build_model(config), config, group=object(), parallel=Parallel())
    with pytest.raises(TypeError, match=r"parallel must be a graphcap\.Parallel; got dict"):
        CaptureManager(build_model(config), config, parallel={"dp_group": None})


def test_no_group_means_no_peers(config):
    manager = CaptureManager(build_model(config), config, backend="emulated", parallel=Parallel(), progress=False)
    assert manager._peers is None and not Parallel().has_peers


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": 0}, ValueError, r"Parallel\(timeout=\.\.\.\) must be a finite number of seconds > 0; got 0"),
        ({"timeout": True}, ValueError, r"Parallel\(timeout=\.\.\.\) must be a finite number of seconds > 0; got True"),
        ({"failure_timeout": -1.0}, ValueError, r"Parallel\(failure_timeout=\.\.\.\) must be a finite .* got -1\.0"),
        ({"failure_timeout": float("inf")}, ValueError, r"Parallel\(failure_timeout=\.\.\.\) must be .* got inf"),
        ({"failure_timeout": "5"}, ValueError, r"Parallel\(failure_timeout=\.\.\.\) must be .* got '5'"),
        ({"pad_eager": "yes"}, TypeError, r"Parallel\(pad_eager=\.\.\.\) must be None, True or False; got 'yes'"),
        ({"token_counts": 1}, TypeError, r"Parallel\(token_counts=\.\.\.\) must be True or False; got 1"),
        ({"pad_eager": True}, ValueError, r"need a data-parallel group: pass Parallel\(dp_group=\.\.\.\)"),
        ({"token_counts": True}, ValueError, r"need a data-parallel group: pass Parallel\(dp_group=\.\.\.\)"),
    ],
)
def test_bad_options_are_refused_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        Parallel(**kwargs)


def test_options_are_frozen_and_every_field_has_a_docstring():
    options = Parallel(timeout=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout = 1.0  # type: ignore[misc]
    import inspect

    source = inspect.getsource(Parallel)
    for field in dataclasses.fields(Parallel):
        after = source.split(f"    {field.name}:", 1)[1].splitlines()[1].strip()
        assert after.startswith('"""'), f"Parallel.{field.name} has no docstring"
