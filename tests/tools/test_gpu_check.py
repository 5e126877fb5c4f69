"""`tools/gpu_check.py` runs end to end on the CPU (emulated backend, fake CUDA tensors, gloo), so the
GPU plan never rots: every phase prints its prediction next to what it saw, the JSON is complete,
phases that need CUDA say so, cases run in subprocesses with a timeout, and the deadline holds."""

import importlib.util
import json
import sys

from tests.tools import TOOLS, run_tool

PHASES = [f"P{i}" for i in range(12)]


def test_gpu_check_quick_on_cpu_runs_every_phase_it_can_and_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run_tool("gpu_check.py", "--device", "cpu", "--quick", "--out", str(out), OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("gpu_check: ok")
    phases = json.loads(out.read_text())["phases"]
    assert list(phases) == PHASES
    for name in ("P1", "P9"):
        assert phases[name]["status"] == "skipped" and phases[name]["observed"] == "skipped: no CUDA"
    for name, phase in phases.items():
        assert f"{name:<4} {phase['title']}  [{phase['status']}," in result.stdout
        assert phase["status"] in ("ok", "skipped"), (name, phase)
    assert result.stdout.count("     predicted: ") == 10 and result.stdout.count("     saw:       ") == 12
    cases = {name: case for phase in phases.values() for name, case in phase.get("cases", {}).items()}
    assert cases["pipelined"]["mismatches"] == 0
    assert cases["clobber"]["same_pool_intact"] is False  # the emulated pool invalidates a kept view
    assert cases["preflight_table"]["verdicts"]["x[mask] = 0.0"] is None
    assert cases["preflight_table"]["verdicts"]["host.to(cuda)"] == "aten._to_copy"
    assert cases["compiled"]["observed"] == "emulated: 0 compiled run(s) during capture, warning given"
    assert cases["oom_first_key"]["observed"].startswith("first key OOM: 7 of 8 keys captured after it")
    assert cases["invalidated_capture"]["observed"] == "skipped: no CUDA"
    assert "agreement on gloo" in cases["agreement"]["observed"]


def test_list_prints_each_phase_with_its_prediction_and_runs_nothing():
    result = run_tool("gpu_check.py", "--list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[::2]] == PHASES
    assert all(line.startswith("     predicted: ") for line in lines[1::2])
    assert "P9   Llama-3-8B-shaped capture, memory and timing (needs CUDA), 200 s" in result.stdout


def test_cases_run_in_subprocesses_and_the_deadline_skips_what_no_longer_fits(tmp_path):
    out = tmp_path / "gpu_check.json"
    args = (
        "--device",
        "cpu",
        "--quick",
        "--out",
        str(out),
        "--only",
        "P4,P7",
        "--isolate",
        "always",
        "--deadline",
        "60",
    )
    result = run_tool("gpu_check.py", *args, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    phases = json.loads(out.read_text())["phases"]
    assert list(phases) == ["P0", "P4", "P7", "P11"]
    assert phases["P4"]["cases"]["clobber"]["ok"] and phases["P7"]["cases"]["compiled"]["ok"]

    result = run_tool("gpu_check.py", "--device", "cpu", "--out", str(out), "--only", "P2", "--deadline", "5")
    phases = json.loads(out.read_text())["phases"]
    assert phases["P2"]["observed"].startswith("skipped:") and "left of the deadline" in phases["P2"]["observed"]
    assert phases["P11"]["status"] == "ok"


def test_a_case_past_its_timeout_is_reported_not_waited_for(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", TOOLS / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool prepends its folders
    spec.loader.exec_module(gpu_check)
    record = gpu_check._case_in_subprocess("tiny", "cpu", True, timeout=0.2)  # cannot even import torch
    assert record["ok"] is False and record["observed"] == "timeout after 0 s"
