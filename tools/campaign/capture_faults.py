"""Faults injected during capture (an error, out of memory, Ctrl-C) at every phase, and a report
write that fails after the pass.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from graphcap import CaptureError, StepBatch
from graphcap.capture.verification import assert_close
from graphcap.report_files import atomic_write
from graphcap.testing import (
    FAULT_SIZES,
    FAULTS,
    PHASES,
    assert_nothing_left,
    leftover_temp_files,
    make_config,
    make_manager,
)

from .trials import Row, Scale, Tally

OLD_REPORT = '{"graphcap_report": 1, "note": "the complete report of an earlier pass"}\n'


FAULT_KINDS = [
    ("forward raises at one size", "error", "raise"),
    ("forward raises at one size", "error", "skip"),
    ("`torch.OutOfMemoryError` at the largest size", "oom", "raise"),
    ("`torch.OutOfMemoryError` at the largest size", "oom", "skip"),
    ("`KeyboardInterrupt` mid-capture", "interrupt", "raise"),
    ("`KeyboardInterrupt` mid-capture", "interrupt", "skip"),
]
PROBE = StepBatch([1, 2], [5, 3], [4, 5, 6], [[1, 2], [3, 0]])


def _fault_trial(manager, path: Path, kind: str, on_error: str, on_call: int, size: int, old: str | None) -> None:
    if old is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write(path, old)
    manager.model.arm(size, FAULTS[kind], on_call)
    failing = [k for k in manager.registry.capture_order() if k.num_tokens == size]
    if kind == "interrupt" or on_error == "raise":
        expected = KeyboardInterrupt if kind == "interrupt" else CaptureError
        try:
            manager.capture()
        except expected as exc:
            if expected is CaptureError:
                message = str(exc)
                if not message.startswith(f"capturing {failing[0]} failed"):
                    raise AssertionError(f"does not name {failing[0]}: {message}") from None
                if kind == "oom" and "capture.on_error: skip" not in message:
                    raise AssertionError(f"no memory hint: {message}") from None
        else:
            raise AssertionError(f"no {expected.__name__}")
        assert_nothing_left(manager)
        if (path.read_text() if path.exists() else None) != old or leftover_temp_files(path):
            raise AssertionError("the report on disk changed or a temporary file remains")
    else:
        report = manager.capture()
        if {r.key for r in report.skipped} != set(failing) or set(manager.graphs) & set(failing):
            raise AssertionError(
                f"skipped {[str(r.key) for r in report.skipped]}, expected {[str(k) for k in failing]}"
            )
        want = "out of memory" if kind == "oom" else "injected fault"
        if not all(want in r.reason for r in report.skipped):
            raise AssertionError(f"reason lacks {want!r}: {report.skipped[0].reason}")
        if manager.backend.memory_in_use() != sum(g.memory_bytes for g in manager.graphs.values()):
            raise AssertionError("memory held beyond the captured graphs")
        if json.loads(path.read_text())["num_skipped"] != len(failing):
            raise AssertionError("the report on disk is not this pass's")
        assert_close(manager.execute(PROBE).clone(), manager.eager(PROBE))
    manager.model.disarm()  # and the manager captures again, fully
    report = manager.capture()
    if len(report.captured) != len(manager.registry.planned):
        raise AssertionError("the manager could not capture again")
    assert_close(manager.execute(PROBE).clone(), manager.eager(PROBE))


def fault_rows(scale: Scale, workdir: Path) -> list[Row]:
    rows = []
    for what, kind, on_error in FAULT_KINDS:
        path = workdir / f"{kind}-{on_error}.json"
        config = make_config(FAULT_SIZES, capture__on_error=on_error, report__path=str(path))
        manager = make_manager(config, faulty=True)
        tally = Tally()
        for trial in range(scale.faults):
            on_call = 1 + trial % len(PHASES)  # warmup, capture (the checked recording), verify
            # Size 2's probes are all kept results of size 4's (graphcap.capture.references): no eager run to fail.
            verify = PHASES[on_call] == "verify"
            size = 4 if kind == "oom" or verify else (2, 4)[(trial // len(PHASES)) % 2]
            old = OLD_REPORT if trial % 2 == 0 else None
            with tally.trial(f"{kind} {on_error} call {on_call} size {size}"):
                _fault_trial(manager, path, kind, on_error, on_call, size, old)
        if on_error == "skip" and kind != "interrupt":
            outcome = "size recorded as skipped with its reason, rest captured, step correct, captured again"
        elif kind == "interrupt":
            outcome = "propagated; GC restored, no graph or memory left, report unchanged, captured again"
        else:
            outcome = "CaptureError naming the key (+ hint); nothing left, report unchanged, captured again"
        rows.append(tally.row("faults", f"{what}, `on_error: {on_error}` (warmup/capture/verify)", outcome))

    tally = Tally()
    for trial in range(scale.report_writes):
        path = workdir / f"write-{trial}.yaml"
        atomic_write(path, OLD_REPORT)
        manager = make_manager(make_config(FAULT_SIZES, report__path=str(path)))
        exc_type = (KeyboardInterrupt, OSError)[trial % 2]
        expected = KeyboardInterrupt if exc_type is KeyboardInterrupt else CaptureError
        with tally.trial(f"{exc_type.__name__} in fsync"):
            fsync = os.fsync

            def fail(fd, exc_type=exc_type):
                raise exc_type("injected")

            os.fsync = fail
            try:
                manager.capture()
            except expected:
                pass
            else:
                raise AssertionError("the write did not fail")
            finally:
                os.fsync = fsync
            assert_nothing_left(manager)  # the pass is undone, not left half-done
            if path.read_text() != OLD_REPORT or leftover_temp_files(path):
                raise AssertionError("the old report changed or a temporary file remains")
            manager.capture()
            if yaml.safe_load(path.read_text())["num_graphs"] != len(manager.registry.planned):
                raise AssertionError("the next write is wrong")
    rows.append(
        tally.row(
            "faults",
            "report write fails after the pass (`KeyboardInterrupt` / `OSError` before the rename)",
            "pass undone (no graph left), old report whole, no temporary file, next write complete",
        )
    )
    return rows
