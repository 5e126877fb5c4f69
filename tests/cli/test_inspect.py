"""`graphcap inspect FILE`: a post-mortem's steps, re-checked; exit 0 (all hold), 1 (one breaks), 2 (bad file)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from graphcap.cli import main
from graphcap.testing import make_config, make_manager
from tests.postmortem_cases import CUDA_ASSERT, decode, device_asserts, founding_bug, prefill


def postmortem(tmp_path, *, bug: bool) -> str:
    config = make_config({"report.postmortem": str(tmp_path), "report.flight_steps": 3, "checks.invariants": "off"})
    manager = make_manager(config)
    manager.capture()
    device_asserts(manager, at=None if bug else 2)
    manager.execute(decode(2))
    if bug:
        founding_bug(manager)
    with pytest.raises(RuntimeError, match=CUDA_ASSERT):
        manager.execute(prefill())
    return str(tmp_path / "graphcap-postmortem.json")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_names_the_first_step_and_field_the_founding_bug_broke(tmp_path, capsys):
    code, out, err = run(capsys, "inspect", postmortem(tmp_path, bug=True))
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"RuntimeError left execute() in phase replay: {CUDA_ASSERT}"
    assert lines[-3].split()[1:] == ["2", "mixed(tokens=4,", "reqs=4)", "replay", "replay", "3", "1", "BROKEN",
                                     "query_start_loc"]  # fmt: skip
    assert lines[-2].startswith("first broken: step 2 (mixed(tokens=4, reqs=4), replay): query_start_loc[2] is 0")
    assert lines[-1] == "  its staged query_start_loc: [0, 3, 0, 0, 0]"
    assert err.strip() == "graphcap inspect: failed: step 2 breaks an invariant: query_start_loc[2]"


def test_inspect_of_steps_that_all_hold_prints_the_phase_key_counts_and_what_to_try(tmp_path, capsys):
    code, out, _ = run(capsys, "inspect", postmortem(tmp_path, bug=False))
    assert code == 0
    assert "every recorded step holds its invariants: the staged rows are not what failed" in out
    assert "the last staged step: mixed(tokens=4, reqs=4) (replay, phase replay), 3 real tokens, 1 real requests" in out
    assert "graphcap verify --config YOUR_CONFIG" in out and "checks.sample_every" in out


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", r"not JSON \(line 1"),
        ('{"graphcap_report": 1}', "not a graphcap post-mortem"),
        ('{"graphcap_postmortem": 99}', "post-mortem format 99; this graphcap reads format 1"),
        ('{"graphcap_postmortem": 1, "error": {}}', "its 'limits' entry is missing"),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys, text, match):
    path = tmp_path / "x.json"
    path.write_text(text)
    code, out, err = run(capsys, "inspect", str(path))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"graphcap inspect: error: {path}: ")
    assert re.search(match, err), err


def test_a_file_with_broken_rows_is_exit_2(tmp_path, capsys):
    path = Path(postmortem(tmp_path, bug=False))
    document = json.loads(path.read_text())
    document["steps"][0]["rows"] = "@@not base64@@"
    path.write_text(json.dumps(document))
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 2 and "a malformed entry" in err


def test_a_missing_file_is_exit_2(tmp_path, capsys):
    code, _, err = run(capsys, "inspect", str(tmp_path / "none.json"))
    assert code == 2 and "cannot be read: No such file or directory" in err


def test_inspect_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "graphcap inspect graphcap-postmortem.json" in capsys.readouterr().out
