"""`python -m graphcap` and the console script import the same code and find factories the same way.

`python -m` puts the current directory first on `sys.path`; a console script does not. Both
now drop it for graphcap's own imports (a stray `yaml.py` must not shadow PyYAML) and search
it last for `model.factory` modules (a factory next to the config works with either).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
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

def make(config):
    return build_model(replace(config, model=replace(config.model, factory=None, name="tiny-llama")))
"""


def _entry_points(tmp_path: Path) -> dict[str, list[str]]:
    """The two ways to start graphcap; the console script as pip writes it (its directory first on sys.path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "graphcap"
    script.write_text("import sys\nfrom graphcap.cli import console_main\nsys.exit(console_main())\n")
    return {"python -m graphcap": [sys.executable, "-m", "graphcap"], "console script": [sys.executable, str(script)]}


def _run(command: list[str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture
def workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    return work


@pytest.mark.parametrize("entry", ["python -m graphcap", "console script"])
def test_both_entry_points_find_a_factory_module_in_the_current_directory(tmp_path, workdir, entry):
    (workdir / "cwd_model.py").write_text(FACTORY)
    command = _entry_points(tmp_path)[entry]
    result = _run(command, workdir, "capture", "--config", "tiny.yaml", "--set", "model.factory=cwd_model:make")
    assert result.returncode == 0, result.stderr
    assert "model cwd_model:make on cpu" in result.stderr and "graphs captured: 4 of 4 keys" in result.stdout


@pytest.mark.parametrize("entry", ["python -m graphcap", "console script"])
def test_files_in_the_current_directory_never_shadow_installed_packages(tmp_path, workdir, entry):
    for name in ("yaml", "numpy", "torch"):
        (workdir / f"{name}.py").write_text(f"raise SystemExit('the stray {name}.py in the current directory ran')\n")
    command = _entry_points(tmp_path)[entry]
    result = _run(command, workdir, "sizes", "--config", "tiny.yaml")
    assert result.returncode == 0, result.stderr
    assert "memory estimate" in result.stdout


def test_the_installed_console_script_runs_console_main():
    script = shutil.which("graphcap", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("graphcap is not installed as a console script next to this interpreter")
    text = Path(script).read_text()
    assert "from graphcap.cli import console_main" in text
