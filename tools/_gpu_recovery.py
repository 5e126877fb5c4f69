"""gpu_check cases around capture on the device's own stack: the budget reservation under a full cache, the
waits CUDA's sync-debug mode refuses, and `graphcap capture` of the embedded default config. Each case is
`(device, quick) -> dict` with `ok` (as predicted), `observed` (one line) and its numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from graphcap.backends import get_backend
from graphcap.config.byte_counts import format_bytes

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = {"ok": True, "observed": "skipped: no CUDA"}
CLI_SECONDS = 150  # the command's own timeout (the phase's subprocess timeout ends it sooner)


def reserve_full_cache(device: str, quick: bool) -> dict:
    """A reservation larger than the free memory but within what the allocator caches: it must be taken."""
    if not device.startswith("cuda"):
        return NO_CUDA
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    filler = torch.empty(int(free * 0.8), dtype=torch.uint8, device=device)
    del filler  # cached by the allocator: no longer free on the device
    free_now = torch.cuda.mem_get_info(device)[0]
    budget = free_now + int(free * 0.4)
    backend = get_backend("cuda", device)
    try:
        took = backend.reserve(budget)
        outcome = f"reserved {format_bytes(took)}"
    except torch.OutOfMemoryError as exc:
        took, outcome = 0, f"out of memory ({str(exc).splitlines()[0][:100]})"
    finally:
        backend.reset()
        torch.cuda.empty_cache()
    observed = f"{format_bytes(budget)} with {format_bytes(free_now)} free and the rest cached: {outcome}"
    return {"ok": took >= budget, "observed": observed, "budget": budget, "free": free_now, "took": took}


def _waits(device: str) -> dict:
    """Waits and syncs, and whether graphcap's docs say sync-debug mode "error" refuses each."""
    x = torch.ones(4, device=device)
    stream, event = torch.cuda.Stream(device), torch.cuda.Event()
    event.record()
    return {
        "x.sum().item()": (lambda: x.sum().item(), True),
        "x.cpu()": (lambda: x.cpu(), True),
        "x.tolist()": (lambda: x.tolist(), True),
        "Stream.synchronize()": (lambda: stream.synchronize(), True),
        "torch.cuda.synchronize()": (lambda: torch.cuda.synchronize(device), None),
        "Event.synchronize()": (lambda: event.synchronize(), None),
        "Stream.wait_event(event)": (lambda: stream.wait_event(event), False),
        "Stream.wait_stream(current)": (lambda: stream.wait_stream(torch.cuda.current_stream(device)), False),
    }


def sync_debug_waits(device: str, quick: bool) -> dict:
    """Which waits `set_sync_debug_mode("error")` refuses on this torch (None in the table: not predicted)."""
    if not device.startswith("cuda"):
        return NO_CUDA
    seen, wrong = {}, []
    previous = torch.cuda.get_sync_debug_mode()
    for name, (fn, predicted) in _waits(device).items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            refused = False
        except RuntimeError as exc:
            refused = "synchronizing" in str(exc)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        seen[name] = "refused" if refused else "allowed"
        if predicted is not None and refused != predicted:
            wrong.append(name)
    torch.cuda.synchronize(device)
    observed = ", ".join(f"{name}: {verdict}" for name, verdict in seen.items())
    return {"ok": not wrong, "observed": observed + (f"; not as documented: {wrong}" if wrong else ""), "waits": seen}


def cli_capture(device: str, quick: bool) -> dict:
    """`graphcap capture` of the embedded default config on `device`: every key captured and verified."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "graphcap", "capture", "--device", device, "--no-progress", "-q"]
        command += ["--report", str(report)] + (["--set", "capture.max_size=4"] if quick else [])
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=CLI_SECONDS)
        if done.returncode != 0 or not report.exists():
            tail = (done.stderr or done.stdout).strip()[-300:]
            return {"ok": False, "observed": f"graphcap capture exited {done.returncode}: {tail}"}
        written = json.loads(report.read_text())
    records = written["graphs"]
    good = sum(r["status"] == "captured" and r["verified"] for r in records)
    env = written.get("environment", {})
    driver = env.get("cuda_driver_api", env.get("cuda_driver_api_missing"))
    observed = f"{good} of {len(records)} keys captured and verified; {env.get('device_name')}"
    if device.startswith("cuda"):
        observed += f", CUDA driver API {driver}"
    return {"ok": good == len(records) > 0, "observed": observed, "environment": env}


CASES = {
    "reserve_full_cache": reserve_full_cache,
    "sync_debug_waits": sync_debug_waits,
    "cli_capture": cli_capture,
}
