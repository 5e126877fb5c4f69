"""gpu_check's runner: each case of a phase in-process or in its own subprocess (its own process group)
with a timeout, what a case checkpointed kept when it is killed, and the results file rewritten as the
run goes. Cases are the functions in `CASES` of the `_gpu_*` modules beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _gpu_report import PARTIAL

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "gpu_check.py"
CASE_MODULES = ("_gpu_cases", "_gpu_llama", "_gpu_steps", "_gpu_probes", "_gpu_recovery", "_gpu_pytest")


def run_phase(phase, device: str, quick: bool, isolate: bool, seconds: float, progress) -> dict:
    cases, ends = {}, time.monotonic() + seconds
    for name in phase.cases:
        left = ends - time.monotonic()
        if left < 3:
            cases[name] = {"ok": False, "observed": "skipped: the phase ran out of its budget"}
        elif isolate:
            cases[name] = _case_in_subprocess(name, device, quick, left)
        else:
            cases[name] = _case_here(name, device, quick)
        progress(cases)
    ok = all(c.get("ok") for c in cases.values())
    observed = "; ".join(str(c.get("observed", "")) for c in cases.values())
    return {"status": "ok" if ok else "failed", "observed": observed, "cases": cases}


def _case_here(name: str, device: str, quick: bool) -> dict:
    try:
        result = _case_function(name)(device, quick)
        if device.startswith("cuda") and not result.get("poisoned"):
            import torch

            torch.cuda.synchronize(device)  # an asynchronous error of the case shows here, in its case
        return result
    except Exception as exc:  # a case that breaks reports it; the run goes on
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return {
            "ok": False,
            "observed": f"error: {type(exc).__name__}: {str(exc).strip()[:300]}",
            "traceback": lines[-6:],
        }


def _case_in_subprocess(name: str, device: str, quick: bool, timeout: float) -> dict:
    """Run one case in a fresh process group; past `timeout` the whole group is killed (pytest's too)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "case.json"
        command = [sys.executable, str(SCRIPT), "--case", name, "--device", device]
        command += ["--result", str(result)] + (["--quick"] if quick else [])
        partial = Path(tmp) / "partial.json"
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, PARTIAL: str(partial)},
            start_new_session=True,
        )
        try:
            _, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            try:  # a process outside the group (a compile worker of its own session) may hold the pipes
                _, stderr = child.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                stderr = "(the case's pipes stayed open after it was killed)"
            return _timed_out(timeout, stderr, partial)
        if result.exists():
            return json.loads(result.read_text())
        return {"ok": False, "observed": f"crashed (exit {child.returncode})", "stderr": (stderr or "")[-1500:]}


def _timed_out(timeout: float, stderr: str | None, partial: Path) -> dict:
    """The record of a case stopped at its timeout, with what it checkpointed (`_gpu_report.checkpoint`)."""
    record = {"ok": False, "observed": f"timeout after {timeout:.0f} s", "stderr": (stderr or "")[-400:]}
    if partial.exists():
        record["partial"] = json.loads(partial.read_text())
        record["observed"] += f"; it had checkpointed: {', '.join(record['partial'])}"
    return record


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        child.kill()


def run_case_here(case: str, device: str, quick: bool, result: str) -> int:
    """`gpu_check.py --case`: run one case, write its record as JSON to `result`."""
    record = _case_here(case, device, quick)
    Path(result).write_text(json.dumps(record, default=str))
    return 0


def _case_function(name: str):
    import importlib

    for module in map(importlib.import_module, CASE_MODULES):
        if name in module.CASES:
            return module.CASES[name]
    raise KeyError(f"no case {name!r}")


def write(path: Path, results: dict) -> None:
    from graphcap.report_files import atomic_write

    atomic_write(path, json.dumps(results, indent=2, default=str) + "\n")
