"""What a gpu_check run reports besides its cases: the environment, the verdict, and the log it tees."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

PARTIAL = "GPU_CHECK_PARTIAL"
"""Environment variable naming the file a case running in a subprocess checkpoints into."""


def checkpoint(record: dict) -> None:
    """Save what a long case has seen so far; if it times out, gpu_check reports this instead of nothing."""
    path = os.environ.get(PARTIAL)
    if path:
        temporary = Path(path + ".tmp")
        temporary.write_text(json.dumps(record, default=str))
        temporary.replace(path)


class Log:
    """Prints to stdout and appends to the log file (beside the JSON), flushing every line."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(text + "\n")


def environment(device: str, torch) -> dict:
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
            cuda_driver_api=_driver_api(),
        )
    return env


def _driver_api() -> int | str:
    from graphcap.backends.cuda_driver import cuda_driver_api

    value, missing = cuda_driver_api()
    return value if value is not None else f"none: {missing}"


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


def verdict(phases: dict, num_phases: int) -> dict:
    """Failures, then everything that did not run (phases and cases, with why): never "all as predicted"
    unless every phase and case ran. `phases` are the records so far (the first is the environment);
    `num_phases` how many phases there are besides the environment and the verdict."""
    body = {name: r for name, r in list(phases.items())[1:] if r["status"] != "running"}  # not the verdict itself
    failed = [name for name, r in body.items() if r["status"] == "failed"]
    skipped = {name: r for name, r in body.items() if r["status"] == "skipped"}
    not_run = [f"{name} ({r['observed'].removeprefix('skipped: ')})" for name, r in skipped.items()]
    cases_not_run = [
        f"{case} ({c['observed'].removeprefix('skipped: ')})"
        for r in body.values()
        for case, c in r.get("cases", {}).items()
        if str(c.get("observed", "")).startswith("skipped:")
    ]
    ran = len(body) - len(not_run)
    unselected = num_phases - len(body)
    parts = [f"{ran} of {len(body)} phases ran" + (f" ({unselected} not selected)" if unselected else "")]
    if failed:
        parts.append("NOT as predicted: " + ", ".join(failed))
    elif not not_run and not cases_not_run:
        parts.append("all as predicted")
    else:
        parts.append("as predicted where run")
    if not_run:
        parts.append("not run: " + ", ".join(not_run))
    if cases_not_run:
        parts.append("cases not run: " + ", ".join(cases_not_run))
    deadline_cut = [name for name, r in body.items() if _cut_short(r)]
    rerun = f"python3 tools/gpu_check.py --only {','.join(deadline_cut)}" if deadline_cut else None
    if rerun:
        parts.append(f"rerun: {rerun}")
    if failed:
        final = f"FAILED ({', '.join(failed)})"
    elif not_run or cases_not_run:
        final = f"ok where run; {len(not_run)} phases and {len(cases_not_run)} cases did not run (see the verdict)"
    elif unselected:
        final = "ok, every selected phase ran as predicted"
    else:
        final = "ok, everything ran as predicted"
    return {"status": "failed" if failed else "ok", "observed": "; ".join(parts), "final": final, "rerun": rerun}


def _cut_short(record: dict) -> bool:
    """Whether a phase did not run, or not to its end, for time: the deadline, its budget, the second plan."""
    observed = str(record["observed"])
    if record["status"] == "skipped":
        return "deadline" in observed or "second plan" in observed
    return any(
        str(case.get("observed", "")).startswith(("skipped: the phase ran out of its budget", "timeout after"))
        for case in record.get("cases", {}).values()
    )
