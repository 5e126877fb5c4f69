"""One GPU run that settles the CUDA backend: phases P0-P11, each printing its prediction next to what it saw.

The plan of docs/gpu (and of the CUDA backend review, section 3): the CUDA tests, pipelined
real batches compared with eager, the cross-graph output probe, the failure paths (C1, C2,
R1, a real OOM), the preflight table on real CUDA, torch.compile, the data-parallel agreement
on one NCCL rank, the 8B-shaped capture with memory and replay-vs-eager timing, and piecewise
capture (one CUDAGraph per piece, eager attention between them).

- A global deadline (default 450 s, ~7.5 min): a phase that no longer fits is skipped.
- The JSON (`--out`) is rewritten after every phase, so a run cut short keeps what it saw.
- On CUDA every case runs in its own subprocess with a timeout: a poisoned CUDA context
  (a device-side assert is sticky) or a hang ends that case, not the run. On the CPU cases
  run in-process (`--isolate always` forces subprocesses there too).
- `--device cpu` runs what a CPU can (the emulated backend, fake-CUDA preflight verdicts,
  gloo); phases that need CUDA report "skipped: no CUDA". CI runs it that way.

    python tools/gpu_check.py --list                  # the phases and their predictions
    python tools/gpu_check.py                         # the full run on the best device
    python tools/gpu_check.py --device cpu --quick    # what CI runs
"""

from __future__ import annotations

import argparse
import json
import os
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


@dataclass(frozen=True)
class Phase:
    name: str
    title: str
    budget: float
    """Seconds the phase may take (all its cases); its cases share it."""
    prediction: str
    cases: tuple[str, ...]
    """Case functions (in _gpu_steps / _gpu_probes), each run alone; () for P0 and P11."""
    needs_cuda: bool = False


PHASES = (
    Phase("P0", "environment of the target device", 10, "-", ()),
    Phase(
        "P1",
        "pytest tests/backends/test_cuda.py",
        75,
        "all pass (before the fixes: C1's use_count INTERNAL ASSERT)",
        ("cuda_tests",),
        True,
    ),
    Phase(
        "P2",
        "tiny config, sync_debug: capture, verify, time",
        40,
        "every key captured and verified; replay faster than eager at small sizes",
        ("tiny",),
    ),
    Phase(
        "P3",
        "pipelined real batches, no sync between steps",
        40,
        "every step equals eager (uploads ordered on the target device's stream)",
        ("pipelined",),
    ),
    Phase(
        "P4",
        "cross-graph output probe",
        30,
        "a view kept past another graph's replay changes within a pool; another manager's step leaves it intact (W1)",
        ("clobber",),
    ),
    Phase(
        "P5",
        "failure paths: real OOM, invalidated capture, sticky assert",
        75,
        "the rest of the pass captures after an OOM (C1) and after an invalidated capture (C2); "
        "a device assert stops the pass with one message (R1)",
        ("oom_first_key", "invalidated_capture", "sticky_assert"),
    ),
    Phase(
        "P6",
        "preflight table on real CUDA",
        30,
        "every capture-illegal form named; x[mask] = 0.0 not flagged and captured; "
        "raw illegal captures invalidated, and the next capture works (C3, C2)",
        ("preflight_table",),
    ),
    Phase(
        "P7",
        "torch.compile through warmup and capture",
        60,
        "cuda: the capture runs the compiled code (before the fix: 0 compiled frames), and an inductor "
        "graph replays faster; emulated: a warning",
        ("compiled", "compiled_inductor"),
    ),
    Phase(
        "P8",
        "data-parallel agreement on one rank",
        40,
        "nccl group: agreement on a gloo group, < 1 ms per step (before: a device sync and a sleep-poll per step)",
        ("agreement",),
    ),
    Phase(
        "P9",
        "Llama-3-8B-shaped capture, memory and timing",
        200,
        "86 keys captured; pool about the largest graph (S3: ~7 GiB of logits no longer held); "
        "decode replay several times faster",
        ("llama8b",),
        True,
    ),
    Phase(
        "P10",
        "piecewise capture around eager per-request attention",
        60,
        "every key captured and verified (pieces on one pool, .item() attention between them); every step "
        "up to the max replays a graph and equals eager",
        ("piecewise",),
    ),
    Phase("P11", "verdict", 5, "-", ()),
)


def main() -> int:
    args = _parse()
    if args.case:
        return _run_case_here(args)
    if args.list:
        for phase in PHASES:
            need = " (needs CUDA)" if phase.needs_cuda else ""
            print(f"{phase.name:<4} {phase.title}{need}, {phase.budget:.0f} s\n     predicted: {phase.prediction}")
        return 0
    import torch  # after --list: listing needs no torch

    device = _device(args.device, torch)
    on_cuda = device.startswith("cuda")
    isolate = args.isolate == "always" or (args.isolate == "auto" and on_cuda)
    deadline = time.monotonic() + args.deadline
    out = Path(args.out)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "quick": args.quick, "phases": {}}
    only = set(args.only.split(",")) if args.only else None
    for phase in PHASES:
        if only is not None and phase.name not in only and phase.name not in ("P0", "P11"):
            continue
        started = time.monotonic()
        if phase.name == "P0":
            record = {"status": "ok", "observed": "", **_environment(device, torch)}
            record["observed"] = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("status", "observed"))
        elif phase.name == "P11":
            record = _verdict(results["phases"])
        elif phase.needs_cuda and not on_cuda:
            record = {"status": "skipped", "observed": "skipped: no CUDA"}
        elif deadline - started < phase.budget / 2:  # it would most likely be cut short
            record = {"status": "skipped", "observed": f"skipped: {deadline - started:.0f} s left of the deadline"}
        else:
            record = _run_phase(phase, device, args.quick, isolate, min(phase.budget, deadline - started))
        record["seconds"] = round(time.monotonic() - started, 2)
        results["phases"][phase.name] = {"title": phase.title, "prediction": phase.prediction, **record}
        _print(phase, record)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        _write(out, results)
    ok = results["phases"]["P11"]["status"] == "ok"
    print(f"\nresults written to {out}\ngpu_check: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--out", default="gpu_check.json", help="JSON results, rewritten after every phase")
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole run (default 450)")
    parser.add_argument("--quick", action="store_true", help="small schedules and few steps (a smoke run)")
    parser.add_argument("--only", help="comma-separated phases to run (P0 and P11 always run), e.g. P3,P4")
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


def _run_phase(phase: Phase, device: str, quick: bool, isolate: bool, seconds: float) -> dict:
    cases, ends = {}, time.monotonic() + seconds
    for name in phase.cases:
        left = ends - time.monotonic()
        if left < 3:
            cases[name] = {"ok": False, "observed": "skipped: the phase ran out of its budget"}
        elif isolate:
            cases[name] = _case_in_subprocess(name, device, quick, left)
        else:
            cases[name] = _case_here(name, device, quick)
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
        lines = traceback.format_exception(exc)
        return {
            "ok": False,
            "observed": f"error: {type(exc).__name__}: {str(exc).strip()[:300]}",
            "traceback": lines[-6:],
        }


def _case_in_subprocess(name: str, device: str, quick: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "case.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--case",
            name,
            "--device",
            device,
            "--result",
            str(result),
        ]
        command += ["--quick"] if quick else []
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=os.environ)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-400:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {"ok": False, "observed": f"timeout after {timeout:.0f} s", "stderr": tail}
        if result.exists():
            return json.loads(result.read_text())
        return {"ok": False, "observed": f"crashed (exit {done.returncode})", "stderr": done.stderr[-1500:]}


def _run_case_here(args: argparse.Namespace) -> int:
    record = _case_here(args.case, args.device, args.quick)
    Path(args.result).write_text(json.dumps(record, default=str))
    return 0


def _case_function(name: str):
    import _gpu_probes
    import _gpu_steps

    for module in (_gpu_steps, _gpu_probes):
        if name in module.CASES:
            return module.CASES[name]
    raise KeyError(f"no case {name!r}")


def _environment(device: str, torch) -> dict:
    import platform

    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            nccl=_nccl_version(torch),
            driver=_driver_version(),
        )
    return env


def _nccl_version(torch) -> str | None:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _verdict(phases: dict) -> dict:
    bad = [f"{name} {r['status']}" for name, r in phases.items() if r["status"] not in ("ok", "skipped")]
    ran = sum(r["status"] != "skipped" for r in phases.values())
    observed = f"{ran} phases ran, {len(phases) - ran} skipped; " + (
        "all as predicted" if not bad else "not as predicted: " + ", ".join(bad)
    )
    return {"status": "ok" if not bad else "failed", "observed": observed}


def _print(phase: Phase, record: dict) -> None:
    print(f"{phase.name:<4} {phase.title}  [{record['status']}, {record['seconds']:.1f} s]", flush=True)
    if phase.prediction != "-":
        print(f"     predicted: {phase.prediction}")
    print(f"     saw:       {record['observed']}", flush=True)


def _write(path: Path, results: dict) -> None:
    from graphcap.report import atomic_write

    atomic_write(path, json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
