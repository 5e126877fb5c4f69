"""`tools/gpu_check.py` runs end to end on the CPU (emulated backend, fake CUDA tensors, gloo), so the
GPU plan never rots: every phase prints its prediction next to what it saw, the JSON and the log are
complete and land under $OUT, phases that need CUDA say so and the verdict lists what did not run (never
"all as predicted" then), cases run in subprocesses with a timeout, and the deadline holds."""

import importlib.util
import json
import sys

from tests.tools import TOOLS, run_tool

PHASES = ["P0", "P10", "P7", "P6", "P2", "P13", "P4", "P1", "P14", "P12", "P18", "P3", "P5"]
PHASES += ["P8", "P9", "P11", "P15", "P16", "P17"]  # the second plan, then the verdict
NEEDS_CUDA = ["P10", "P1", "P3", "P5", "P16"]
H200_MINUTES = 8  # what one command may take on an H200


def test_gpu_check_quick_on_cpu_runs_every_phase_it_can_and_says_what_did_not_run(tmp_path):
    result = run_tool("gpu_check.py", "--device", "cpu", "--quick", OMP_NUM_THREADS="1", OUT=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    phases = json.loads((tmp_path / "gpu_check.json").read_text())["phases"]
    assert (tmp_path / "gpu_check.log").read_text() == result.stdout  # the log is the whole of stdout
    assert list(phases) == PHASES
    for name in NEEDS_CUDA:
        assert phases[name]["status"] == "skipped" and phases[name]["observed"] == "skipped: no CUDA"
    for name, phase in phases.items():
        assert f"{name:<4} {phase['title']}  [{phase['status']}," in result.stdout
        assert phase["status"] in ("ok", "skipped"), (name, phase)
    assert result.stdout.count("     predicted: ") == 17 and result.stdout.count("     saw:       ") == 19
    verdict = phases["P17"]["observed"]
    assert "all as predicted" not in verdict and "as predicted where run" in verdict
    assert "not run: P10 (no CUDA), P1 (no CUDA), P3 (no CUDA), P5 (no CUDA), P16 (no CUDA)" in verdict
    not_run = ("invalidated_capture", "reserve_full_cache", "sticky_assert", "sync_debug_waits")
    assert "cases not run: " + ", ".join(f"{case} (no CUDA)" for case in not_run) in verdict
    assert result.stdout.rstrip().endswith(
        "gpu_check: ok where run; 5 phases and 4 cases did not run (see the verdict)"
    )
    cases = {name: case for phase in phases.values() for name, case in phase.get("cases", {}).items()}
    assert cases["pipelined"]["mismatches"] == 0
    assert cases["clobber"]["same_pool_intact"] is False  # the emulated pool invalidates a kept view
    assert cases["preflight_table"]["verdicts"]["x[mask] = 0.0"] is None
    assert cases["preflight_table"]["verdicts"]["host.to(cuda)"] == "aten._to_copy"
    assert cases["compiled"]["observed"] == "emulated: 0 compiled run(s) during capture, warning given"
    assert cases["oom_first_key"]["observed"].startswith("first key OOM: 7 of 8 keys captured after it")
    assert "a stale tail is refused: query_start_loc[3]" in cases["founding_bug_execute"]["observed"]
    assert "query_start_loc [0, 3, 5, 0, 0" in cases["founding_bug_raw"]["observed"]
    assert cases["release_recapture"]["ok"] and cases["compiled_model"]["ok"] and cases["bf16_tolerance"]["ok"]
    assert "agreement on gloo" in cases["agreement"]["observed"]
    assert cases["cli_capture"]["ok"] and "keys captured and verified" in cases["cli_capture"]["observed"]


def test_list_prints_each_phase_with_its_prediction_and_runs_nothing():
    result = run_tool("gpu_check.py", "--list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[::2]] == PHASES
    assert all(line.startswith("     predicted: ") for line in lines[1::2])
    assert "P1   NCCL all-reduce captured in a CUDA graph (one GPU, world size 1) (needs CUDA), 15 s" in result.stdout
    assert "P8   torch.compile through warmup and capture" in result.stdout and "45 s [second plan]" in result.stdout
    assert "103 keys captured and verified" in result.stdout


def test_each_plans_phase_budgets_fit_the_deadline_and_the_deadline_fits_eight_minutes(monkeypatch):
    gpu_check = _load_gpu_check(monkeypatch)
    import _gpu_pytest

    first = [p for p in gpu_check.PHASES if not p.second]
    second = [p for p in gpu_check.PHASES if p.second or p.name in (gpu_check.FIRST, gpu_check.LAST)]
    assert sum(p.budget for p in first) <= gpu_check.DEFAULT_DEADLINE
    assert sum(p.budget for p in second) <= gpu_check.DEFAULT_DEADLINE
    assert gpu_check.DEFAULT_DEADLINE + 30 <= H200_MINUTES * 60  # the last case's write and the exit fit too
    names = [p.name for p in first]
    assert names[:6] == ["P0", "P10", "P7", "P6", "P2", "P13"]  # most telling first
    assert max(map(names.index, ["P1", "P14", "P12", "P18"])) < min(map(names.index, ["P3", "P5"]))  # 8B last
    (cuda_tests,) = [p for p in gpu_check.PHASES if p.cases == ("cuda_tests",)]
    assert cuda_tests.budget > _gpu_pytest.CUDA_TESTS_SECONDS  # pytest reports what ran before the phase ends
    assert _gpu_pytest.PER_TEST_SECONDS * 4 < _gpu_pytest.CUDA_TESTS_SECONDS  # a hung test leaves time for the rest
    assert "tests/backends/test_cuda_engine.py" in _gpu_pytest.CUDA_TEST_FILES
    cases = [case for p in first for case in p.cases]
    for case in ("invalidated_capture", "reserve_full_cache", "sync_debug_waits", "cli_capture"):
        assert case in cases


def test_a_cuda_run_defers_the_second_plan_and_its_verdict_prints_the_rerun(monkeypatch):
    _load_gpu_check(monkeypatch)  # puts tools/ on the path
    phases = {"P0": {"status": "ok", "observed": ""}, "P10": {"status": "ok", "observed": "all passed"}}
    phases["P8"] = {"status": "skipped", "observed": "skipped: in the second plan (--plan second)"}
    phases["P9"] = {"status": "skipped", "observed": "skipped: in the second plan (--plan second)"}
    import _gpu_report

    result = _gpu_report.verdict(phases, 3)
    assert result["rerun"] == "python3 tools/gpu_check.py --only P8,P9"
    assert "not run: P8 (in the second plan (--plan second)), P9" in result["observed"]


def test_cases_run_in_subprocesses_and_the_deadline_skips_what_no_longer_fits(tmp_path):
    out = tmp_path / "gpu_check.json"
    args = ("--device", "cpu", "--quick", "--out", str(out), "--only", "P6,P12", "--isolate", "always")
    result = run_tool("gpu_check.py", *args, "--deadline", "120", OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    phases = json.loads(out.read_text())["phases"]
    assert list(phases) == ["P0", "P6", "P12", "P17"]
    assert phases["P12"]["cases"]["clobber"]["ok"] and phases["P6"]["cases"]["founding_bug_raw"]["ok"]
    assert result.stdout.rstrip().endswith("gpu_check: ok, every selected phase ran as predicted")

    result = run_tool("gpu_check.py", "--device", "cpu", "--out", str(out), "--only", "P2,P4", "--deadline", "5")
    phases = json.loads(out.read_text())["phases"]
    assert phases["P2"]["observed"].startswith("skipped:") and "left of the deadline" in phases["P2"]["observed"]
    assert phases["P17"]["status"] == "ok" and "rerun: python3 tools/gpu_check.py --only P2,P4" in result.stdout


def _load_gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", TOOLS / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool prepends its folders
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_a_case_past_its_timeout_is_reported_not_waited_for(monkeypatch):
    _load_gpu_check(monkeypatch)
    import _gpu_run

    record = _gpu_run._case_in_subprocess("tiny", "cpu", True, timeout=0.2)  # cannot even import torch
    assert record["ok"] is False and record["observed"] == "timeout after 0 s"


def test_a_timed_out_case_reports_what_it_checkpointed(monkeypatch, tmp_path):
    _load_gpu_check(monkeypatch)
    import _gpu_report
    import _gpu_run

    partial = tmp_path / "partial.json"
    monkeypatch.setenv(_gpu_report.PARTIAL, str(partial))
    _gpu_report.checkpoint({"seconds_per_key": {"uniform(tokens=512, reqs=512)": {"capture": 0.4}}})
    record = _gpu_run._timed_out(150.0, "", partial)
    assert record["observed"] == "timeout after 150 s; it had checkpointed: seconds_per_key"
    assert record["partial"]["seconds_per_key"]["uniform(tokens=512, reqs=512)"] == {"capture": 0.4}
