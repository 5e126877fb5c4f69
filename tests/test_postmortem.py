"""The flight recorder and the post-mortem: what a step or capture that died leaves behind.

A CUDA-style error (`CUDA error: device-side assert triggered`) leaving `execute` or `capture` writes
the recorder's last steps to `report.postmortem`, names the file on the error and re-raises the error
unchanged; the file re-checks without torch (`graphcap.postmortem.recheck`) and names the step and
field the founding bug broke.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphcap import BatchError, ConfigError, InvariantViolation
from graphcap.backends.preflight import preflight
from graphcap.phases import failed_in
from graphcap.postmortem.file import POSTMORTEM_MARKER
from graphcap.postmortem.recheck import load_postmortem, recheck
from graphcap.testing import FAULT_SIZES, make_config
from tests.postmortem_cases import (
    CUDA_ASSERT,
    crash,
    cuda_error,
    decode,
    device_asserts,
    founding_bug,
    manager_for,
    prefill,
)

ROOT = Path(__file__).resolve().parents[1]


def test_a_cuda_error_at_a_chosen_step_writes_the_postmortem_and_reraises_the_same_error(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=3)
    manager.execute(decode(2))
    manager.execute(decode(3))
    error = crash(manager, decode(4))
    path = tmp_path / "graphcap-postmortem.json"
    assert type(error) is RuntimeError and error.args == cuda_error().args  # unchanged
    assert error.__notes__ == [
        f"graphcap: post-mortem of the last 4 staged steps in {path} (run: graphcap inspect {path})"
    ]
    assert error.graphcap_postmortem == str(path)
    document = load_postmortem(path)
    assert document["error"] == {"type": "RuntimeError", "message": str(cuda_error()), "call": "execute",
                                 "phase": "replay"}  # fmt: skip
    steps = document["steps"][-3:]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["key_text"] for s in steps] == ["uniform(tokens=2, reqs=2)"] + ["uniform(tokens=4, reqs=4)"] * 2
    assert [(s["mode"], s["phase"], s["num_tokens"], s["num_reqs"]) for s in steps] == [
        ("replay", "replay", 2, 2), ("replay", "replay", 3, 3), ("replay", "replay", 4, 4)
    ]  # fmt: skip
    assert document["steps"][0]["mode"] == "capture" and document["steps"][0]["step"] is None
    assert [c.violation for c in recheck(document)] == [None] * 4  # the rows were right: the kernel failed


def test_the_recorded_rows_are_the_rows_the_step_staged(tmp_path):
    manager = manager_for(tmp_path, steps=2)
    manager.capture()
    device_asserts(manager, at=1)
    crash(manager, decode(3, seq_len=6))
    host = manager.buffers.layout.views(4, 4).host  # the key's views, still holding the failed step's rows
    step = load_postmortem(tmp_path / "graphcap-postmortem.json")["steps"][-1]
    rows = np.frombuffer(base64.b64decode(step["rows"]), np.uint8)
    for name, start, nbytes in step["spans"]:
        view = host[name]
        assert nbytes == view.nbytes and rows[start : start + nbytes].tobytes() == view.tobytes(), name
    assert {name for name, _, _ in step["spans"]} == set(host)


def test_the_same_corruption_under_basic_invariants_raises_invariant_violation_and_writes_no_postmortem(tmp_path):
    manager = manager_for(tmp_path, invariants="basic")
    manager.capture()
    device_asserts(manager)
    founding_bug(manager)
    with pytest.raises(InvariantViolation, match=r"query_start_loc\[2\]"):
        manager.execute(prefill())
    assert not (tmp_path / "graphcap-postmortem.json").exists()


def test_the_ring_keeps_the_last_k_steps_oldest_first(tmp_path):
    manager = manager_for(tmp_path, steps=2)
    manager.capture()
    device_asserts(manager, at=5)
    for _ in range(4):
        manager.execute(decode(2))
    crash(manager, decode(3))
    steps = load_postmortem(tmp_path / "graphcap-postmortem.json")["steps"]
    assert [(s["step"], s["num_reqs"]) for s in steps] == [(4, 2), (5, 3)]


def test_an_eager_step_records_its_mode_and_reason(tmp_path):
    manager = manager_for(tmp_path, **{"capture.mode": "none"})
    manager.capture()
    manager.model.arm(2, cuda_error, on_call=2)
    manager.execute(decode(2))
    with pytest.raises(RuntimeError, match=CUDA_ASSERT):
        manager.execute(decode(2))
    document = load_postmortem(tmp_path / "graphcap-postmortem.json")
    assert document["error"]["phase"] == "eager"
    assert [(s["mode"], s["reason"]) for s in document["steps"]] == [("eager", "mode_none")] * 2


@pytest.mark.parametrize(("on_call", "phase"), [(1, "warmup"), (2, "recording"), (3, "verify")])
def test_a_cuda_error_in_a_capture_phase_writes_the_postmortem_naming_the_phase(tmp_path, on_call, phase):
    manager = manager_for(tmp_path, **FAULT_SIZES)
    manager.model.arm(4, cuda_error, on_call=on_call, uniform=True)
    with pytest.raises(Exception, match=CUDA_ASSERT) as info:
        manager.capture()
    path = tmp_path / "graphcap-postmortem.json"
    assert f"graphcap inspect {path}" in info.value.__notes__[-1]
    document = load_postmortem(path)
    assert document["error"]["call"] == "capture" and document["error"]["phase"] == phase
    last = document["steps"][-1]
    assert last["key_text"] == "uniform(tokens=4, reqs=4)" or phase == "verify"
    assert last["mode"] == "capture" and last["phase"] == ("verify" if phase == "verify" else "capture")
    assert [c.violation for c in recheck(document)] == [None] * len(document["steps"])


def test_the_preflight_is_named_as_the_failing_phase():
    with pytest.raises(RuntimeError) as info, preflight("cpu"):
        raise cuda_error()
    assert failed_in(info.value) == "preflight"


def test_an_invariant_violation_or_a_refused_batch_writes_no_postmortem(tmp_path):
    manager = manager_for(tmp_path, invariants="basic")
    manager.capture()
    with pytest.raises(BatchError, match="max_num_seqs"):
        manager.execute(decode(9))  # more requests than batching.max_num_seqs: refused
    assert not list(tmp_path.iterdir())


def test_flight_steps_0_keeps_no_recorder_and_writes_no_file(tmp_path):
    manager = manager_for(tmp_path, steps=0)
    assert manager._flight is None and manager._scope.on_failure is None
    manager.capture()
    device_asserts(manager, at=1)
    error = crash(manager, decode(2))
    assert not hasattr(error, "__notes__") and not list(tmp_path.iterdir())


def test_a_file_graphcap_did_not_write_is_left_alone_and_the_error_says_so(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=1)
    theirs = tmp_path / "graphcap-postmortem.json"
    theirs.write_text("engine notes\n")
    error = crash(manager, decode(2))
    assert theirs.read_text() == "engine notes\n"
    assert "could not be written" in error.__notes__[-1] and "is not a graphcap post-mortem" in error.__notes__[-1]
    assert error.args == cuda_error().args


def test_a_second_crash_replaces_the_postmortem_graphcap_wrote(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=1)
    crash(manager, decode(2))
    first = (tmp_path / "graphcap-postmortem.json").read_text()
    assert first.startswith('{\n "' + POSTMORTEM_MARKER + '"')
    device_asserts(manager, at=1)
    crash(manager, decode(3))
    assert (tmp_path / "graphcap-postmortem.json").read_text() != first


def test_a_failing_write_never_hides_the_original_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    manager = manager_for(tmp_path, **{"report.postmortem": str(blocker / "under")})  # a directory under a file
    manager.capture()
    device_asserts(manager, at=1)
    error = crash(manager, decode(2))
    assert type(error) is RuntimeError and error.args == cuda_error().args
    assert error.__notes__[-1].startswith(f"graphcap: the post-mortem could not be written to {blocker}")


def test_a_write_that_raises_inside_graphcap_never_hides_the_original_error(tmp_path, monkeypatch):
    import graphcap.postmortem.file as file

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file, "atomic_write", broken)
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=1)
    error = crash(manager, decode(2))
    assert error.args == cuda_error().args and "No space left on device" in error.__notes__[-1]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"report.postmortem": "crash.txt"}, r"report\.postmortem: must be a \.json file or a directory"),
        ({"report.postmortem": ""}, r"report\.postmortem: must be a \.json file or a directory"),
        ({"report.flight_steps": -1}, r"report\.flight_steps"),
        ({"report.flight_steps": 4096}, r"report\.flight_steps"),
    ],
)
def test_bad_postmortem_settings_are_config_errors_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_config(overrides)


def test_the_recheck_runs_without_torch(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=1)
    crash(manager, decode(2))
    code = (
        "import sys; from graphcap.cli import main; code = main(['inspect', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "graphcap-postmortem.json")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "every recorded step holds its invariants" in result.stdout


def test_the_file_is_json_with_the_marker_first(tmp_path):
    manager = manager_for(tmp_path)
    manager.capture()
    device_asserts(manager, at=1)
    crash(manager, decode(2))
    document = json.loads((tmp_path / "graphcap-postmortem.json").read_text())
    assert next(iter(document)) == POSTMORTEM_MARKER and document["rank"] is None
    assert document["limits"]["pad"]["slot"] == -1 and document["invariants"] == "off"


def test_a_postmortem_path_from_a_config_file_stays_under_its_directory_or_the_working_directory(tmp_path, monkeypatch):
    from graphcap import load_config

    work, project = tmp_path / "work", tmp_path / "project"
    work.mkdir()
    project.mkdir()
    monkeypatch.chdir(work)
    config = project / "c.yaml"
    config.write_text("device: cpu\nreport:\n  postmortem: ../../crashes\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: report\.postmortem: \.\./\.\./crashes resolves to .*, outside"):
        load_config(config)
    assert load_config(config, {"report.postmortem": "../../crashes"}).report.postmortem == "../../crashes"
    config.write_text("device: cpu\nreport:\n  postmortem: crashes\n")
    assert load_config(config).report.postmortem == "crashes"


def test_a_cuda_error_leaving_capture_pending_writes_the_postmortem(tmp_path):
    manager = manager_for(tmp_path, **FAULT_SIZES, **{"capture.strategy": "lazy"})
    manager.capture()  # lazy: captures nothing
    manager.model.arm(4, cuda_error, on_call=1, uniform=True)
    with pytest.raises(Exception, match=CUDA_ASSERT) as info:
        manager.capture_pending()
    document = load_postmortem(tmp_path / "graphcap-postmortem.json")
    assert document["error"]["call"] == "capture_pending" and document["error"]["phase"] == "warmup"
    assert str(tmp_path / "graphcap-postmortem.json") in info.value.__notes__[-1]


def test_without_exception_notes_the_path_goes_to_the_log(caplog):
    from graphcap.postmortem.file import _note

    class NoNotes:  # Python 3.10's exceptions have no add_note
        pass

    with caplog.at_level("ERROR", logger="graphcap"):
        _note(NoNotes(), "graphcap: post-mortem of the last 2 staged steps in x.json")
    assert caplog.messages == ["graphcap: post-mortem of the last 2 staged steps in x.json"]
