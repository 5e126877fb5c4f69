"""Faults during capture: a failing forward, out of memory, KeyboardInterrupt, a failed report write.

`capture.on_error: raise` ends with `CaptureError` naming the key (with a memory hint for
out of memory); `skip` records the key with its reason and captures the rest. On every path
GC is restored, no graph stays registered or holds memory, the report on disk is complete
or absent (or the old complete one), and the manager captures again.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from graphcap import CaptureError, ConfigError, GraphKey, StepBatch
from graphcap.testing import (
    FAULT_SIZES,
    FAULTS,
    PHASES,
    assert_nothing_left,
    leftover_temp_files,
    make_config,
    make_manager,
)

OLD_REPORT = '{"graphcap_report": 1, "note": "the complete report of an earlier pass"}\n'  # a report graphcap wrote: it may be replaced
LARGE = {GraphKey(4, 4, True), GraphKey(4, 4, False)}
SMALL = {GraphKey(2, 2, True), GraphKey(2, 2, False)}
STEP = StepBatch([1, 2], [5, 3], [4, 5, 6], [[1, 2], [3, 0]])  # 3 tokens: pads to a size-4 key


@pytest.fixture
def report_path(tmp_path):
    return tmp_path / "capture.json"


def faulty_manager(report_path, on_error="raise"):
    config = make_config(FAULT_SIZES, capture__on_error=on_error, report__path=str(report_path))
    return make_manager(config, faulty=True)


def assert_report_untouched(path, old_text):
    assert (path.read_text() if path.exists() else None) == old_text
    assert not leftover_temp_files(path)


def assert_captures_again(manager, report_path):
    manager.model.disarm()
    report = manager.capture()
    assert {r.key for r in report.captured} == set(manager.registry.planned) == set(manager.graphs)
    assert json.loads(report_path.read_text())["num_graphs"] == len(manager.registry.planned)
    assert manager.dispatch(STEP) is not None
    torch.testing.assert_close(manager.execute(STEP).clone(), manager.eager(STEP))


def _late_key(on_call: int) -> tuple[int, str]:
    """A key captured after another graph, whose `on_call`-th forward runs: size 2 (after both size-4 graphs) for a
    warmup or a capture; for verification uniform(4, 4), after mixed(4, 4) (size 2's probes are all kept results)."""
    return (4, "4") if PHASES[on_call] == "verify" else (2, "2")


@pytest.mark.parametrize("on_call", list(PHASES), ids=PHASES.get)
def test_forward_error_raises_capture_error_naming_the_key_and_leaves_nothing(report_path, on_call):
    manager = faulty_manager(report_path)
    report_path.write_text(OLD_REPORT)
    size, shown = _late_key(on_call)
    manager.model.arm(size, FAULTS["error"], on_call, uniform=True)
    match = rf"capturing uniform\(tokens={shown}, reqs={shown}\) failed: RuntimeError: injected"
    with pytest.raises(CaptureError, match=match):
        manager.capture()
    assert_nothing_left(manager)
    assert_report_untouched(report_path, OLD_REPORT)
    assert_captures_again(manager, report_path)


@pytest.mark.parametrize("kind", ["oom", "oom_no_message"])
def test_oom_at_the_largest_size_raises_with_the_memory_hint(report_path, kind):
    manager = faulty_manager(report_path)
    manager.model.arm(4, FAULTS[kind], on_call=2)  # the capture
    with pytest.raises(CaptureError) as info:
        manager.capture()
    message = str(info.value)
    assert message.startswith("capturing uniform(tokens=4, reqs=4) failed: out of memory")
    for hint in ("capture.sizes", "capture.max_size", "capture.on_error: skip"):
        assert hint in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert_nothing_left(manager)
    assert_report_untouched(report_path, None)
    assert_captures_again(manager, report_path)


@pytest.mark.parametrize(
    ("kind", "on_call", "reason"),
    [
        ("oom", 2, "out of memory (CUDA out of memory. Tried to allocate"),
        ("oom_no_message", 1, "out of memory (no message)"),
        ("error", 2, "RuntimeError: injected fault"),
        ("error", 3, "RuntimeError: injected fault"),
    ],
    ids=["oom-capture", "oom-warmup", "error-capture", "error-verify"],
)
def test_skip_records_the_failed_size_with_its_reason_and_captures_the_rest(report_path, kind, on_call, reason):
    manager = faulty_manager(report_path, on_error="skip")
    manager.model.arm(4, FAULTS[kind], on_call)
    report = manager.capture()
    assert {r.key for r in report.skipped} == set(manager.registry.skipped) == LARGE
    assert all(reason in r.reason for r in report.skipped)
    if kind.startswith("oom"):
        assert all("capture.on_error" in r.reason for r in report.skipped)
    assert {r.key for r in report.captured} == set(manager.graphs) == SMALL
    assert manager.backend.memory_in_use() == sum(g.memory_bytes for g in manager.graphs.values()) > 0
    assert manager.registry.captured == SMALL
    data = json.loads(report_path.read_text())
    assert (data["num_graphs"], data["num_skipped"]) == (2, 2)
    # A step of the skipped size runs eagerly, counted as such, and is right.
    assert manager.dispatch(STEP) is None
    torch.testing.assert_close(manager.execute(STEP).clone(), manager.eager(STEP))
    assert manager.stats.eager == {"skipped": 1}
    small = StepBatch([1, 1], [3, 7], [8, 9], [[1, 0], [2, 3]])
    assert manager.dispatch(small) == GraphKey(2, 2, True)
    torch.testing.assert_close(manager.execute(small).clone(), manager.eager(small))


@pytest.mark.parametrize(
    ("on_error", "on_call"),
    [("raise", 2), ("skip", 1), ("skip", 2), ("skip", 3)],
    ids=["raise-capture", "skip-warmup", "skip-capture", "skip-verify"],
)
def test_keyboard_interrupt_mid_capture_propagates_and_leaves_nothing(report_path, on_error, on_call):
    """Never swallowed by `skip`; the graphs captured before it in the pass are released."""
    manager = faulty_manager(report_path, on_error)
    report_path.write_text(OLD_REPORT)
    manager.model.arm(_late_key(on_call)[0], FAULTS["interrupt"], on_call, uniform=True)
    with pytest.raises(KeyboardInterrupt):
        manager.capture()
    assert_nothing_left(manager)
    assert_report_untouched(report_path, OLD_REPORT)
    assert_captures_again(manager, report_path)


def test_a_failed_pass_releases_the_earlier_graphs_and_steps_run_eagerly(report_path):
    manager = faulty_manager(report_path)
    manager.capture()
    complete = report_path.read_text()
    manager.model.arm(4, FAULTS["oom"])
    with pytest.raises(CaptureError):
        manager.capture()
    assert_nothing_left(manager)
    assert_report_untouched(report_path, complete)
    assert manager.dispatch(STEP) is None
    torch.testing.assert_close(manager.execute(STEP).clone(), manager.eager(STEP))
    assert manager.stats.eager == {"not_captured": 1}
    assert_captures_again(manager, report_path)


@pytest.mark.parametrize(
    ("exc", "raised"),
    [(KeyboardInterrupt(), KeyboardInterrupt), (OSError(28, "No space left on device"), CaptureError)],
    ids=["interrupt", "disk-error"],
)
def test_a_failed_report_write_undoes_the_pass_and_keeps_the_old_report_whole(tmp_path, monkeypatch, exc, raised):
    path = tmp_path / "capture.yaml"
    path.write_text(OLD_REPORT)
    manager = make_manager(make_config(report__path=str(path)))

    def fail(fd):
        raise exc

    monkeypatch.setattr(os, "fsync", fail)  # the temporary file is written, not yet renamed
    with pytest.raises(raised) as info:
        manager.capture()
    if raised is CaptureError:
        assert str(info.value).startswith(f"captured {len(manager.registry.planned)} graphs, but writing the report")
        assert f"to {path} failed (OSError: [Errno 28] No space left on device)" in str(info.value)
    assert_nothing_left(manager)  # not half-done: no graph stays registered
    assert_report_untouched(path, OLD_REPORT)
    monkeypatch.undo()
    manager.capture()
    assert yaml.safe_load(path.read_text())["num_graphs"] == len(manager.registry.planned)
    assert not leftover_temp_files(path)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: tmp / "dir.json", "is a directory"),
        (lambda tmp: tmp / "file.json" / "report.json", r"cannot be created: .*file\.json is not a directory"),
    ],
    ids=["directory", "under-a-file"],
)
def test_an_unwritable_report_path_is_refused_before_anything_is_captured(tmp_path, make, match):
    (tmp_path / "file.json").write_text("{}")
    (tmp_path / "dir.json").mkdir()
    manager = make_manager(make_config(report__path=str(make(tmp_path))))
    with pytest.raises(ConfigError, match=rf"report\.path: .*{match}"):
        manager.capture()
    assert manager.graphs == {} and manager.backend.graphs == ()
