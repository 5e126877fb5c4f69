"""Packaging: a non-editable install carries the default config, the license, `py.typed` and one version."""

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import metadata, version
from pathlib import Path

import pytest

import graphcap

ROOT = Path(__file__).resolve().parents[1]


def test_non_editable_install_finds_the_embedded_default_and_carries_license_and_types(tmp_path):
    pytest.importorskip("setuptools")
    # Build from a copy, so the build leaves nothing in the repository.
    source = tmp_path / "src"
    shutil.copytree(ROOT / "graphcap", source / "graphcap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "--target", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "graphcap" / "configs" / "default.yaml").is_file()
    assert (target / "graphcap" / "py.typed").is_file()
    (dist_info,) = target.glob("graphcap-*.dist-info")
    meta = (dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta
    assert "Classifier: Typing :: Typed" in meta
    assert "Apache License" in next(dist_info.rglob("LICENSE")).read_text()
    probe = (
        "import graphcap; c = graphcap.load_config(); "
        "print(graphcap.__file__, c.capture.max_size, graphcap.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: the installed copy must be the one imported
        env={**os.environ, "PYTHONPATH": str(target)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    path, max_size, installed_version = result.stdout.split()
    assert Path(path).is_relative_to(target) and max_size == "64"
    assert installed_version == _pyproject_version()


def _pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"$', text, flags=re.M).group(1)


def test_version_is_written_once_in_pyproject_and_read_from_metadata():
    assert graphcap.__version__ == version("graphcap") == _pyproject_version()
    sources = [p for p in (ROOT / "graphcap").rglob("*.py") if _pyproject_version() in p.read_text()]
    assert sources == [], f"the version is written in {sources}; read graphcap.__version__ instead"


def test_license_file_matches_the_declared_license():
    assert metadata("graphcap")["License-Expression"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_changelog_has_a_section_for_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(_pyproject_version())}\]", text, flags=re.M), "CHANGELOG misses this version"


def test_importing_graphcap_imports_neither_torch_nor_numpy():
    probe = "import sys, graphcap; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_public_names_load_lazily_and_completely():
    for name in graphcap.__all__:
        assert getattr(graphcap, name) is not None
    assert set(graphcap.__all__) <= set(dir(graphcap))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        graphcap.no_such_name  # noqa: B018


def test_each_public_name_is_listed_once_and_loads_from_the_module_that_defines_it():
    """`graphcap/__init__.py` keeps one list (`_EXPORTS`); `__all__` and the type-checking imports match it."""
    import ast
    import importlib
    import inspect

    assert sorted(graphcap._EXPORTS) == sorted(graphcap.__all__) and len(set(graphcap.__all__)) == len(graphcap.__all__)
    tree = ast.parse(inspect.getsource(graphcap))
    guarded = next(node for node in tree.body if isinstance(node, ast.If))  # `if TYPE_CHECKING:`
    imported = {alias.name for node in guarded.body for alias in node.names}
    assert imported == set(graphcap.__all__)
    for name, module in graphcap._EXPORTS.items():
        value = getattr(importlib.import_module(module), name)
        defined_in = getattr(value, "__module__", module)
        assert defined_in == module or not callable(value), f"{name} is defined in {defined_in}, not {module}"
