"""`tools/suite_on.py` (the suite on another Python and torch): the venv made and torch pinned only where
the venv lacks them, graphcap installed editable, pytest's arguments passed on; a missing interpreter is
refused in one line. --dry-run only: a real run installs torch."""

from __future__ import annotations

import sys

from tests.tools import REPO, run_tool


def test_a_new_venv_is_made_with_torch_pinned_then_the_suite_runs_in_it(tmp_path):
    venv = tmp_path / "py312-t211"
    done = run_tool("suite_on.py", "--python", sys.executable, "--torch", "2.11.0", "--venv", str(venv), "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{sys.executable} -m venv {venv}"
    assert lines[1].startswith(f"{venv}/bin/python -m pip install -q torch==2.11.0 numpy")
    assert lines[2] == f"{venv}/bin/python -m pip install -q --no-deps -e {REPO}"
    assert lines[4] == f"{venv}/bin/python -m pytest -q -n 2 -p no:cacheprovider"


def test_an_existing_venv_is_reused_and_pytest_arguments_pass_through(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    args = ("--python", "/nowhere/python", "--torch", "2.11.0", "--venv", str(tmp_path), "--dry-run")
    done = run_tool("suite_on.py", *args, "--", "tests/backends", "-x")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and "torch==" not in done.stdout
    assert lines[-1].endswith("-m pytest -q -n 2 -p no:cacheprovider tests/backends -x")


def test_a_missing_interpreter_is_refused_naming_it(tmp_path):
    done = run_tool(
        "suite_on.py", "--python", "/nowhere/python3.12", "--torch", "2.11.0", "--venv", str(tmp_path / "v")
    )
    assert done.returncode == 2
    assert done.stderr.startswith("suite_on: --python /nowhere/python3.12 does not exist; give the interpreter")
