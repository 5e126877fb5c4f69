"""A non-editable install carries the embedded default config and the console entry points."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_non_editable_install_finds_the_embedded_default(tmp_path):
    pytest.importorskip("setuptools")
    # Build from a copy, so the build leaves nothing in the repository.
    source = tmp_path / "src"
    shutil.copytree(ROOT / "graphcap", source / "graphcap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
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
    probe = "import graphcap; c = graphcap.load_config(); print(graphcap.__file__, c.capture.max_size)"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: the installed copy must be the one imported
        env={**os.environ, "PYTHONPATH": str(target)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    path, max_size = result.stdout.split()
    assert Path(path).is_relative_to(target) and max_size == "64"
