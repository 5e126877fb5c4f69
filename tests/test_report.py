"""`CaptureReport`: where it was made, what each memory number means, the marker that lets graphcap
replace only its own reports; `atomic_write` file modes."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import torch
import yaml

from graphcap import ConfigError, __version__
from graphcap.config.byte_counts import format_bytes
from graphcap.config.fingerprint import config_fingerprint
from graphcap.report import MEMORY_MEANING
from graphcap.report_files import REPORT_MARKER, atomic_write, check_report_path, may_overwrite
from graphcap.testing import make_config, make_manager


@pytest.fixture(scope="module")
def report():
    return make_manager(make_config()).capture()


def test_report_says_where_and_when_it_was_made(report):
    env = report.environment
    assert env["graphcap"] == __version__ and env["torch"] == str(torch.__version__)
    assert env["cuda_runtime"] == torch.version.cuda and env["device_name"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", report.created)
    assert report.config_fingerprint == config_fingerprint(make_config())
    assert report.command is None  # set by the command line


def test_report_labels_what_its_memory_numbers_measure(report):
    data = report.to_dict()
    assert data["memory_meaning"] == MEMORY_MEANING["emulated"]
    assert "not a process peak" in data["memory_meaning"]["pool_bytes"]
    assert "upper bound: emulated graphs replay one at a time" in report.summary()
    assert report.pool_bytes == sum(r.memory_bytes for r in report.captured)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_report_round_trips_with_every_new_field(report, tmp_path, suffix):
    path = report.write(tmp_path / f"r{suffix}")
    data = json.loads(path.read_text()) if suffix == ".json" else yaml.safe_load(path.read_text())
    for key in ("created", "command", "environment", "config_fingerprint", "memory_meaning"):
        assert key in data
    assert all(g["latency"] is None for g in data["graphs"])  # not measured by capture


def test_a_new_file_gets_0666_under_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "new.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o664, 0o444])
def test_a_replaced_file_keeps_its_mode(tmp_path, mode):
    path = tmp_path / "report.json"
    path.write_text("old\n")
    path.chmod(mode)
    atomic_write(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old\n")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, "new\n")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_check_report_path_refuses_what_cannot_or_must_not_be_written(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("device: cpu\n")
    (tmp_path / "link.yaml").symlink_to(config)
    (tmp_path / "file").write_text("")
    cases = {
        str(tmp_path): "is a directory",
        str(config): "is the config file itself",
        str(tmp_path / "link.yaml"): "is the config file itself",  # the same file under another name
        str(tmp_path / "file" / "r.json"): "is not a directory",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=rf"report\.path: .*{message}"):
            check_report_path(path, not_same_as=(str(config),))
    check_report_path(tmp_path / "new" / "dir" / "r.json", not_same_as=(str(config),))  # created on write


@pytest.mark.parametrize(
    ("num", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (3 << 20, "3.0 MiB"),
        (5 << 30, "5.0 GiB"),
        (17 << 40, "17.0 TiB"),
    ],
)
def test_format_bytes(num, text):
    assert format_bytes(num) == text


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_every_report_starts_with_the_marker_key_and_may_be_replaced(report, tmp_path, suffix):
    path = report.write(tmp_path / f"r{suffix}")
    data = json.loads(path.read_text()) if suffix == ".json" else yaml.safe_load(path.read_text())
    assert next(iter(data)) == REPORT_MARKER and data[REPORT_MARKER] == 1
    assert may_overwrite(path)
    report.write(path)  # graphcap's own report: replaced
    check_report_path(path)


def test_a_file_graphcap_did_not_write_is_never_replaced(report, tmp_path):
    workflow = tmp_path / "ci.yml"
    workflow.write_text("on: push\njobs: {}\n")
    note = tmp_path / "notes.json"
    note.write_text('{"note": "' + REPORT_MARKER + '"}\n')  # the word elsewhere is not the marker
    for path in (workflow, note):
        with pytest.raises(ConfigError, match=r"report\.path: .* exists and is not a graphcap report"):
            check_report_path(path)
        with pytest.raises(FileExistsError, match="exists and is not a graphcap report"):
            report.write(path)
    assert workflow.read_text() == "on: push\njobs: {}\n"
    assert note.read_text() == '{"note": "' + REPORT_MARKER + '"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ci.yml", "notes.json"]  # no temporary left


def test_an_empty_file_a_link_and_a_fifo(report, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert may_overwrite(empty)  # nothing to lose: `--report $(mktemp --suffix .json)` works
    mine = report.write(tmp_path / "mine.json")
    (tmp_path / "link.json").symlink_to(mine)
    assert not may_overwrite(tmp_path / "link.json")  # replacing it would not write where it points
    os.mkfifo(tmp_path / "pipe.json")
    assert not may_overwrite(tmp_path / "pipe.json")  # refused without opening it (an open would block)


def test_a_report_path_too_long_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"report\.path: .* cannot be used: File name too long \(ENAMETOOLONG\)"):
        check_report_path(tmp_path / ("r" * 300 + ".json"))
