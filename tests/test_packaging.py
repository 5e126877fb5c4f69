"""Packaging: a non-editable install carries the bundled configs, the license, `py.typed` and one version;
the source distribution is the whole repository, the wheel the package alone."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import metadata, version
from pathlib import Path

import pytest

import graphcap
from graphcap.config import bundled_configs

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
    for name in bundled_configs():
        assert (target / "graphcap" / "configs" / f"{name}.yaml").is_file()
    assert (target / "graphcap" / "py.typed").is_file()
    (dist_info,) = target.glob("graphcap-*.dist-info")
    meta = (dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta
    assert "Classifier: Typing :: Typed" in meta
    assert "Apache License" in next(dist_info.rglob("LICENSE")).read_text()
    probe = (
        "import graphcap; c = graphcap.load_config(); t = graphcap.load_config('tiny-cpu-ci'); "
        "print(graphcap.__file__, c.capture.max_size, t.capture.max_size, graphcap.__version__)"
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
    path, max_size, tiny_max_size, installed_version = result.stdout.split()
    assert Path(path).is_relative_to(target) and max_size == "64" and tiny_max_size == "8"
    assert installed_version == _pyproject_version()


def _tracked_files() -> list[str]:
    """Tracked files and links (a link to a directory, as `capture_configs`, is one entry)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to compare the archives with")
    return [name for name in listed.stdout.splitlines() if (ROOT / name).is_file() or (ROOT / name).is_symlink()]


def _files_of(tracked: list[str]) -> set[str]:
    """The files a checkout of `tracked` holds: a link to a directory stands for the files under it."""
    files = set()
    for name in tracked:
        path = ROOT / name
        if path.is_dir():
            files |= {f"{name}/{p.relative_to(path).as_posix()}" for p in path.rglob("*") if p.is_file()}
        else:
            files.add(name)
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist's and the wheel's file lists, built from a copy of the tracked files (no network)."""
    pytest.importorskip("setuptools")
    tracked = _tracked_files()
    source = tmp_path_factory.mktemp("source")
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_symlink():  # kept a link, as a checkout has it
            os.symlink(os.readlink(ROOT / name), source / name)
        else:
            shutil.copy2(ROOT / name, source / name)
    build = (
        "import sys; from setuptools import build_meta as b; out = sys.argv[1]; "  # build_meta rewrites sys.argv
        "names = b.build_sdist(out), b.build_wheel(out); print('built', *names)"
    )
    dist = source / "dist"
    done = subprocess.run(
        [sys.executable, "-c", build, str(dist)], cwd=source, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built_line,) = [line for line in done.stdout.splitlines() if line.startswith("built ")]
    sdist_name, wheel_name = built_line.split()[1:]
    with tarfile.open(dist / sdist_name) as sdist:
        top = sdist_name.removesuffix(".tar.gz")
        in_sdist = {m.name.removeprefix(f"{top}/") for m in sdist.getmembers() if m.isfile()}
    with zipfile.ZipFile(dist / wheel_name) as wheel:
        in_wheel = set(wheel.namelist())
    return tracked, in_sdist, in_wheel


def test_the_sdist_holds_every_tracked_file(built):
    tracked, in_sdist, _ = built
    missing = sorted(_files_of(tracked) - in_sdist - {".gitignore"})
    assert missing == [], f"the sdist lacks {missing[:10]} (MANIFEST.in)"
    for needed in ("CHANGELOG.md", "docs/BENCHMARKS.md", "tools/reliability.py", "tests/assets/bad_yaml_syntax.yaml"):
        assert needed in in_sdist
    # The tests name bundled configs through the capture_configs link: an unpacked sdist must hold them there.
    assert {f"capture_configs/{name}.yaml" for name in bundled_configs()} <= in_sdist


def test_the_wheel_holds_the_package_and_every_bundled_config_and_no_tests(built):
    _, _, in_wheel = built
    configs = {n for n in in_wheel if n.startswith("graphcap/configs/")}
    assert configs == {f"graphcap/configs/{name}.yaml" for name in bundled_configs()}
    assert "graphcap/py.typed" in in_wheel
    assert not [n for n in in_wheel if n.startswith(("tests/", "tools/", "docs/"))]


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
