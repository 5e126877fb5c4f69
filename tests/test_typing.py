"""A user's script type-checks against the installed package: the README's editable install
(`editable_mode=strict`) shows type checkers `py.typed`, and the public signatures accept what
the docs write. mypy runs in a subprocess from a temporary directory, so it reads graphcap from
site-packages (as a user's checker does), not from this checkout. torch, numpy and the YAML
and progress-bar libraries are skipped (their types read as Any): what is checked is graphcap's
own signatures, in seconds.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (it is in the test extra: .[test])"
)

README = Path(__file__).resolve().parents[1] / "README.md"

MYPY_INI = """\
[mypy]
python_version = 3.10
follow_imports = silent
[mypy-torch.*,numpy.*,yaml.*,tqdm.*]
follow_imports = skip
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module: graphcap is analysed once, each script then in about a second."""
    return tmp_path_factory.mktemp("mypy_cache")


def _mypy(directory: Path, cache: Path, source: str) -> subprocess.CompletedProcess[str]:
    (directory / "user.py").write_text(source)
    (directory / "mypy.ini").write_text(MYPY_INI)
    command = [sys.executable, "-m", "mypy", "user.py", "--config-file", "mypy.ini", "--cache-dir", str(cache)]
    return subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=600)


def _library_block() -> str:
    section = README.read_text().split("## Use it as a library", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```", section, flags=re.S)[0]


def test_the_readme_library_example_type_checks_against_the_installed_package(tmp_path, cache):
    script = _library_block() + (
        "\n"
        "from graphcap import BlockTable, CaptureConfig, CaptureReport\n"
        "kept: CaptureReport = report\n"
        "same: CaptureConfig = config\n"
        "table: BlockTable = manager.block_table\n"
        "table.set_row(0, [1, 2])\n"
        "table.append(0, np.array([3]))\n"
        "refill = StepBatch([1], [3], block_table=manager.block_table, axes={})\n"
    )
    result = _mypy(tmp_path, cache, script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found in 1 source file" in result.stdout


def test_both_documented_sample_forms_type_check(tmp_path, cache):
    script = (
        "import numpy as np\n"
        "from graphcap import BufferSpec\n"
        "\n"
        "def rows(rng: np.random.Generator, num_real_rows: int) -> np.ndarray:\n"
        "    return rng.integers(0, 4, num_real_rows)\n"
        "\n"
        "def slots(rng: np.random.Generator, n: int, axes: dict[str, int]) -> np.ndarray:\n"
        "    return rng.integers(0, max(1, axes.get('lora', 1)), n)\n"
        "\n"
        "plain = BufferSpec('state_ids', 'reqs', pad=0, sample=rows)\n"
        "by_axes = BufferSpec('lora_slots', 'tokens', pad=-1, sample=slots)\n"
        "as_list = BufferSpec('flags', 'tokens', dtype='bool', sample=lambda rng, n: [True] * n)\n"
        "padded = BufferSpec('scale', 'tokens', dtype='float32', pad=1.0, sample='pad')\n"
    )
    result = _mypy(tmp_path, cache, script)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_script_that_breaks_the_public_types_is_reported(tmp_path, cache):
    # The canary: the same check names what a user got wrong, so the passes above are not vacuous.
    script = (
        "from graphcap import BufferSpec, StepBatch\n"
        "def one_arg(rng: object) -> list[int]:\n"
        "    return [0]\n"
        "batch = StepBatch([1], [2], axes={'lora': 'three'})\n"
        "spec = BufferSpec('ids', 'tokens', sample=one_arg)\n"
        "rows = BufferSpec('ids', 'rows')\n"
    )
    result = _mypy(tmp_path, cache, script)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = {int(line.split(":")[1]): line for line in result.stdout.splitlines() if ": error:" in line}
    assert sorted(errors) == [4, 5, 6], result.stdout
    assert "[dict-item]" in errors[4] and '"sample" to "BufferSpec"' in errors[5] and "Literal['tokens'" in errors[6]
