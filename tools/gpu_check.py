"""One GPU run that settles the CUDA backend: phases named P0-P17, run most telling first, each printing its
prediction next to what it saw. The plan is docs/gpu/README.md.

The command (on a CUDA machine, from the repository root; nothing to install):

    python3 tools/gpu_check.py

With `OUT` set (the device machine returns only what is under `$OUT`) the JSON goes to
`$OUT/gpu_check.json` and the log to `$OUT/gpu_check.log`, both rewritten as the run goes, so a
run cut short keeps what it saw. On CUDA it runs the first plan, whose phase budgets sum to the
450 s deadline (7.5 minutes, within 8 on an H200): the environment, the CUDA test files (most of
the GPU tests), release and recapture, the founding bug, the tiny config and lazy capture
within a memory budget, the failure paths, piecewise capture (keys replayed out of capture
order), the 8B-shaped passes, NCCL in a graph, the preflight table and the output probe. The
second plan (`--plan second`, about 150 s: torch.compile, bf16 tolerances, pipelining,
data-parallel agreement, inductor timing) is the rerun the first run's verdict prints.

- A phase that no longer fits the deadline (its predecessors overran) is skipped, and the
  verdict names it and prints the rerun's command (`--only ...`).
- On CUDA every case runs in its own subprocess (its own process group) with a timeout: a
  poisoned CUDA context (a device-side assert is sticky) or a hang ends that case, not the run.
  On the CPU cases run in-process (`--isolate always` forces subprocesses there too).
- `--device cpu` runs what a CPU can of every phase (the emulated backend, fake-CUDA preflight
  verdicts, gloo); phases that need CUDA report "skipped: no CUDA", and the verdict lists every
  phase and case that did not run. CI runs it that way.

    python tools/gpu_check.py --list                  # the phases, their budgets and predictions
    python tools/gpu_check.py --device cpu --quick    # what CI runs
    python3 tools/gpu_check.py --plan second          # the phases the first plan leaves out
    python3 tools/gpu_check.py --only P10,P11         # a rerun of two phases
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # the case modules beside this file, and graphcap

from _gpu_report import PARTIAL, Log, environment, verdict  # noqa: E402  (found through the path set above)

DEFAULT_DEADLINE = 450.0
"""Seconds a run may take: 7.5 minutes, within 8 on an H200 with the final write. Each plan's phase
budgets sum to at most this (tests/tools/test_gpu_check.py checks it), so no phase of the plan is
skipped for time unless the ones before it overran their budgets."""


CPU_BUDGET_SCALE = 4
"""Budgets are an H200's seconds; on the CPU (the emulated backend, a shared CI machine) a phase may take
this many times its budget."""


@dataclass(frozen=True)
class Phase:
    name: str
    title: str
    budget: float
    """Seconds the phase may take (all its cases); its cases share it."""
    prediction: str
    cases: tuple[str, ...]
    """Case functions (in _gpu_cases, _gpu_llama, _gpu_steps, _gpu_probes), each run alone; () for P0 and P17."""
    needs_cuda: bool = False
    second: bool = False
    """Not in a GPU run's first plan (the phases that fit `DEFAULT_DEADLINE`): `--plan second` (or `--only`)
    runs it; the first run's verdict prints that command."""


PHASES = (
    Phase("P0", "environment of the target device", 5, "-", ()),
    Phase(
        "P10",
        "pytest tests/backends/test_cuda.py tests/backends/test_cuda_engine.py",
        110,
        "all pass (replay == eager, pools, preflight, failed captures; the budget reservation used by lazy "
        "captures and following the pool, sync-debug beside an engine thread, capture error modes, "
        "generators, piecewise keys replayed out of order)",
        ("cuda_tests",),
        True,
    ),
    Phase(
        "P7",
        "release the last graph of a pool, then capture on the same backend",
        15,
        "no use_count INTERNAL ASSERT: the capture after a release equals eager; two passes of one manager with a "
        "passed-in backend capture every key",
        ("release_recapture",),
    ),
    Phase(
        "P6",
        "the founding bug: a stale query_start_loc tail",
        25,
        "raw replay with the stale tail: a device-side assert from repeat_interleave (CPU: an error); through "
        "execute the batch equals eager; a corrupted tail is refused before upload",
        ("founding_bug_raw", "founding_bug_execute"),
    ),
    Phase(
        "P2",
        "tiny config, sync_debug: capture, verify, time; lazy capture within a memory budget",
        35,
        "every key captured and verified; replay faster than eager at small sizes; lazy: a step served before "
        "any capture, the budget reserved in the pool, capture_pending() captures every key inside it (the "
        "pool's large and small segments do not grow)",
        ("tiny", "lazy_budget"),
    ),
    Phase(
        "P13",
        "failure paths: real OOM, invalidated capture, sticky assert",
        40,
        "the rest of the pass captures after an OOM and after an invalidated capture; a device assert stops "
        "the pass with one message",
        ("oom_first_key", "invalidated_capture", "sticky_assert"),
    ),
    Phase(
        "P4",
        "piecewise capture around eager per-request attention; keys replayed out of capture order",
        30,
        "every key captured and verified (pieces on one pool, .item() attention between them, sync-debug off "
        "inside it); every step up to the max replays a graph and equals eager; piecewise keys replayed out of "
        "capture order bitwise equal to eager and to their own first replay",
        ("piecewise", "piecewise_order"),
    ),
    Phase(
        "P3",
        "Llama-3-8B-shaped capture: every key, per-key seconds, graph pool from allocator segments",
        100,
        "103 keys captured and verified; the pool's segments within 0.5-2x of the estimate's graphs (4.6 GiB); "
        "decode replay several times faster",
        ("llama8b",),
        True,
    ),
    Phase(
        "P5",
        "piecewise vs full vs eager at 8B decode shapes",
        45,
        "piecewise keys captured; a piecewise pass leaves < 1/4 of what pinned eager-op tensors took allocated",
        ("llama8b_piecewise",),
        True,
    ),
    Phase(
        "P1",
        "NCCL all-reduce captured in a CUDA graph (one GPU, world size 1)",
        15,
        "captured; replay equals eager exactly",
        ("nccl_graph",),
        True,
    ),
    Phase(
        "P14",
        "preflight table on real CUDA",
        15,
        "every capture-illegal form named; x[mask] = 0.0 not flagged and captured; raw illegal captures "
        "invalidated, and the next capture works",
        ("preflight_table",),
    ),
    Phase(
        "P12",
        "cross-graph output probe",
        10,
        "a view kept past another graph's replay changes within a pool; another manager's step leaves it intact",
        ("clobber",),
    ),
    Phase(
        "P8",
        "torch.compile through warmup and capture, and a compiled model in full and piecewise",
        45,
        "cuda: captures run the compiled code, no warning; emulated: a warning; eager steps run compiled code "
        "after a full and a piecewise pass",
        ("compiled", "compiled_model"),
        second=True,
    ),
    Phase(
        "P9",
        "bf16 verification tolerances",
        20,
        "replay vs eager at the same (padded) shape within atol/rtol 0.02 everywhere; norm-relative error "
        "< 1e-2 also at the real shape (other GEMM kernels)",
        ("bf16_tolerance",),
        second=True,
    ),
    Phase(
        "P11",
        "pipelined real batches, no sync between steps",
        20,
        "every step equals eager (uploads ordered on the target device's stream)",
        ("pipelined",),
        second=True,
    ),
    Phase(
        "P15",
        "data-parallel agreement on one rank",
        15,
        "nccl group: agreement on a gloo group, < 1 ms per step",
        ("agreement",),
        second=True,
    ),
    Phase(
        "P16",
        "inductor-compiled vs eager capture: replay time",
        45,
        "the inductor graph replays faster",
        ("compiled_inductor",),
        True,
        second=True,
    ),
    Phase("P17", "verdict", 5, "-", ()),
)
FIRST, LAST = PHASES[0].name, PHASES[-1].name


def main() -> int:
    args = _parse()
    if args.case:
        return _run_case_here(args)
    if args.list:
        for phase in PHASES:
            need = " (needs CUDA)" if phase.needs_cuda else ""
            plan = " [second plan]" if phase.second else ""
            print(f"{phase.name:<4} {phase.title}{need}, {phase.budget:.0f} s{plan}")
            print(f"     predicted: {phase.prediction}")
        return 0
    out = Path(args.out) if args.out else _default_out()
    say = Log(out.with_suffix(".log"))
    import torch  # after --list: listing needs no torch

    device = _device(args.device, torch)
    on_cuda = device.startswith("cuda")
    isolate = args.isolate == "always" or (args.isolate == "auto" and on_cuda)
    deadline = time.monotonic() + args.deadline
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "quick": args.quick, "phases": {}}
    only = set(args.only.split(",")) if args.only else None
    plan = args.plan if args.plan != "auto" else ("first" if on_cuda else "all")
    for phase in PHASES:
        if only is not None and phase.name not in only and phase.name not in (FIRST, LAST):
            continue
        if only is None and plan == "second" and not phase.second and phase.name not in (FIRST, LAST):
            continue
        started = time.monotonic()
        record = {"status": "running", "observed": ""}
        results["phases"][phase.name] = {"title": phase.title, "prediction": phase.prediction, **record}
        if phase.name == FIRST:
            record = {"status": "ok", "observed": "", **environment(device, torch)}
            record["observed"] = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("status", "observed"))
        elif phase.name == LAST:
            record = verdict(results["phases"], len(PHASES) - 2)
        elif phase.needs_cuda and not on_cuda:
            record = {"status": "skipped", "observed": "skipped: no CUDA"}
        elif only is None and plan == "first" and phase.second:
            record = {"status": "skipped", "observed": "skipped: in the second plan (--plan second)"}
        elif deadline - started < phase.budget * (1 if on_cuda else CPU_BUDGET_SCALE) / 2:  # likely cut short
            record = {"status": "skipped", "observed": f"skipped: {deadline - started:.0f} s left of the deadline"}
        else:

            def progress(cases: dict, name: str = phase.name) -> None:  # a run cut short keeps every case
                results["phases"][name]["cases"] = cases
                _write(out, results)

            budget = phase.budget * (1 if on_cuda else CPU_BUDGET_SCALE)
            seconds = min(budget, deadline - started)
            record = _run_phase(phase, device, args.quick, isolate, seconds, progress)
        record["seconds"] = round(time.monotonic() - started, 2)
        results["phases"][phase.name] = {"title": phase.title, "prediction": phase.prediction, **record}
        _print(say, phase, record)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        _write(out, results)
    final = results["phases"][LAST]
    say(f"\nresults written to {out} (log: {say.path})")
    say(f"gpu_check: {final['final']}")
    return 0 if final["status"] == "ok" else 1


def _default_out() -> Path:
    folder = os.environ.get("OUT")
    return Path(folder) / "gpu_check.json" if folder else Path("gpu_check.json")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    parser.add_argument(
        "--out",
        help="JSON results, rewritten after every case (default $OUT/gpu_check.json, else gpu_check.json); "
        "the log goes beside it (.log)",
    )
    parser.add_argument(
        "--deadline", type=float, default=DEFAULT_DEADLINE, help=f"seconds for the whole run ({DEFAULT_DEADLINE:.0f})"
    )
    parser.add_argument("--quick", action="store_true", help="small schedules and few steps (a smoke run)")
    parser.add_argument("--only", help=f"comma-separated phases to run ({FIRST} and {LAST} always run), e.g. P10,P11")
    parser.add_argument(
        "--plan",
        choices=("auto", "first", "second", "all"),
        default="auto",
        help="which phases: first (what fits the deadline, most telling first), second (the rest), all; "
        "auto: first on CUDA, all on the CPU",
    )
    parser.add_argument("--isolate", choices=("auto", "always", "never"), default="auto", help="a subprocess per case")
    parser.add_argument("--list", action="store_true", help="print the phases and their predictions, run nothing")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, write its JSON
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def _device(requested: str, torch) -> str:
    from graphcap.backends import resolve_device

    device = resolve_device(requested)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _run_phase(phase: Phase, device: str, quick: bool, isolate: bool, seconds: float, progress) -> dict:
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
        command = [sys.executable, str(Path(__file__).resolve()), "--case", name, "--device", device]
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


def _run_case_here(args: argparse.Namespace) -> int:
    record = _case_here(args.case, args.device, args.quick)
    Path(args.result).write_text(json.dumps(record, default=str))
    return 0


def _case_function(name: str):
    import _gpu_cases
    import _gpu_llama
    import _gpu_probes
    import _gpu_steps

    for module in (_gpu_cases, _gpu_llama, _gpu_steps, _gpu_probes):
        if name in module.CASES:
            return module.CASES[name]
    raise KeyError(f"no case {name!r}")


def _print(say: Log, phase: Phase, record: dict) -> None:
    say(f"{phase.name:<4} {phase.title}  [{record['status']}, {record['seconds']:.1f} s]")
    if phase.prediction != "-":
        say(f"     predicted: {phase.prediction}")
    say(f"     saw:       {record['observed']}")


def _write(path: Path, results: dict) -> None:
    from graphcap.report_files import atomic_write

    atomic_write(path, json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
