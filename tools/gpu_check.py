"""One GPU run that settles the CUDA backend: phases named P0-P18, run most telling first, each printing its
prediction next to what it saw. The plan is docs/gpu/README.md.

The command (on a CUDA machine, from the repository root; nothing to install):

    python3 tools/gpu_check.py

With `OUT` set (the device machine returns only what is under `$OUT`) the JSON goes to
`$OUT/gpu_check.json` and the log to `$OUT/gpu_check.log`, both rewritten as the run goes, so a
run cut short keeps what it saw. On CUDA it runs the first plan, whose phase budgets sum to the
450 s deadline (7.5 minutes, within 8 on an H200): the environment, the CUDA test files (most of
the GPU tests, each under its own timeout), release and recapture, the founding bug, the tiny
config and lazy capture within a memory budget, the failure paths (a capture a sync invalidates
and the generators after it, the reservation under a full cache), piecewise capture (keys
replayed out of capture order), NCCL in a graph, the preflight table and the waits sync-debug
mode refuses, the output probe, `graphcap capture` of the default config, then the 8B-shaped
passes. The second plan (`--plan second`, about 150 s: torch.compile, bf16 tolerances,
pipelining, data-parallel agreement, inductor timing) is the rerun the first run's verdict prints.

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
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # the case modules beside this file, and graphcap

from _gpu_report import Log, environment, verdict  # noqa: E402  (found through the path set above)
from _gpu_run import run_case_here, run_phase, write  # noqa: E402

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
        115,
        "all pass, each within its own timeout (replay == eager, pools, preflight, captures broken by a sync "
        "and by a refused copy, the generators after them, the reservation from cached memory; the budget "
        "reservation used by lazy captures and following the pool, sync-debug beside an engine thread, capture "
        "error modes, generators, piecewise keys replayed out of order)",
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
        "failure paths: real OOM, a capture a sync invalidates, the reservation under a full cache, sticky assert",
        45,
        "the rest of the pass captures after an OOM and after a capture CUDA invalidated (named so), whose "
        "generators then draw eagerly; a budget above the free memory is reserved from the cache; a device "
        "assert stops the pass with one message",
        ("oom_first_key", "invalidated_capture", "reserve_full_cache", "sticky_assert"),
    ),
    Phase(
        "P4",
        "piecewise capture around eager per-request attention; keys replayed out of capture order",
        25,
        "every key captured and verified (pieces on one pool, .item() attention between them, sync-debug off "
        "inside it); every step up to the max replays a graph and equals eager; piecewise keys replayed out of "
        "capture order bitwise equal to eager and to their own first replay",
        ("piecewise", "piecewise_order"),
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
        "preflight table on real CUDA; the waits sync-debug mode refuses",
        20,
        "every capture-illegal form named; x[mask] = 0.0 not flagged and captured; raw illegal captures "
        "invalidated by CUDA or refused by torch (pageable copies), and the next capture works; .item(), "
        ".cpu(), .tolist(), Stream.synchronize() refused by sync-debug, stream waits allowed",
        ("preflight_table", "sync_debug_waits"),
    ),
    Phase(
        "P12",
        "cross-graph output probe",
        10,
        "a view kept past another graph's replay changes within a pool; another manager's step leaves it intact",
        ("clobber",),
    ),
    Phase(
        "P18",
        "graphcap capture of the embedded default config on the device",
        20,
        "every key captured and verified; the report names the GPU and the CUDA driver API version",
        ("cli_capture",),
    ),
    Phase(
        "P3",
        "Llama-3-8B-shaped capture: every key, per-key seconds, graph pool from allocator segments",
        80,
        "103 keys captured and verified; the pool's segments within 0.5-2x of the estimate's graphs (4.6 GiB, "
        "saved after every key); "
        "decode replay several times faster",
        ("llama8b",),
        True,
    ),
    Phase(
        "P5",
        "piecewise vs full vs eager at 8B decode shapes",
        35,
        "piecewise keys captured; a piecewise pass leaves < 1/4 of what pinned eager-op tensors took allocated",
        ("llama8b_piecewise",),
        True,
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
        return run_case_here(args.case, args.device, args.quick, args.result)
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
                write(out, results)

            budget = phase.budget * (1 if on_cuda else CPU_BUDGET_SCALE)
            seconds = min(budget, deadline - started)
            record = run_phase(phase, device, args.quick, isolate, seconds, progress)
        record["seconds"] = round(time.monotonic() - started, 2)
        results["phases"][phase.name] = {"title": phase.title, "prediction": phase.prediction, **record}
        _print(say, phase, record)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write(out, results)
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


def _print(say: Log, phase: Phase, record: dict) -> None:
    say(f"{phase.name:<4} {phase.title}  [{record['status']}, {record['seconds']:.1f} s]")
    if phase.prediction != "-":
        say(f"     predicted: {phase.prediction}")
    say(f"     saw:       {record['observed']}")


if __name__ == "__main__":
    sys.exit(main())
