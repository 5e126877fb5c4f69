"""`graphcap validate`: every problem of every file, exit 2 if any, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from graphcap.cli import main
from tests.conftest import ASSETS

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "graphcap" / "configs" / "default.yaml")


def test_validate_good_file_prints_ok_and_exits_0(capsys):
    assert main(["validate", DEFAULT, str(ASSETS / "good_float_exponent.yaml")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{DEFAULT}: ok", f"{ASSETS / 'good_float_exponent.yaml'}: ok"]
    assert err == ""


def test_validate_bad_file_lists_every_problem_and_exits_2(capsys):
    path = str(ASSETS / "bad_many_problems.yaml")
    assert main(["validate", path]) == 2
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"{path}: 6 problems"
    assert lines[1].startswith(f"  {path}:4: model.num_heads: hidden_size 100 is not divisible by num_heads 8")
    assert lines[-1].startswith(f"  {path}:14: checks.verify_replay: expected true or false; got 'yes'")
    assert len(lines) == 7
    assert err == "1 of 1 config invalid\n"
    assert "Traceback" not in out + err


def test_validate_missing_file_exits_2_without_a_traceback(capsys, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert main(["validate", DEFAULT, missing]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"{DEFAULT}: ok",
        f"{missing}: config file not found: {missing} (configs shipped with graphcap, loadable by name: "
        "decode-only, default, llama3-8b-h200, spec-decode, tiny-cpu-ci)",
    ]
    assert err == "1 of 2 configs invalid\n"


def test_validate_applies_set_overrides_to_every_file(capsys):
    assert main(["validate", DEFAULT, "--set", "capture.max_size=0"]) == 2
    out, _ = capsys.readouterr()
    assert "override: capture.max_size: must be >= 1; got 0" in out


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("capture.max_size", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("capture.sizes=[1, 2", "not valid YAML"),
    ],
)
def test_validate_bad_set_is_a_one_line_error_with_exit_2(capsys, value, match):
    assert main(["validate", DEFAULT, "--set", value]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"graphcap validate: error: --set {value!r}: ") and match in err
    assert err.count("\n") == 1


def test_python_m_graphcap_validate_exits_2_with_problems_and_no_traceback():
    bad = str(ASSETS / "bad_yaml11_off_in_bool.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "graphcap", "validate", bad, DEFAULT],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"{bad}:3: checks.verify_replay:" in result.stdout and "YAML 1.1" in result.stdout
    assert f"{DEFAULT}: ok" in result.stdout
    assert "Traceback" not in result.stderr and result.stderr.strip() == "1 of 2 configs invalid"
