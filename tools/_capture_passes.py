"""`bench_capture.py --apart`: re-capture passes with the emulated backend's checks in its recording (the
default) against passes that run a separate checked preflight per key first (`checks_in_capture` off, as a
backend whose capture checks nothing does), interleaved in pairs in one process (which goes first alternates)."""

from __future__ import annotations

import numpy as np
import torch

from graphcap import CaptureManager, load_config
from graphcap.models import build_model


def checks_apart(path: str | None, rounds: int, quick: bool, threads: int | None) -> int:
    """Seconds of re-captures (after a weight swap) with the checks in the recording vs in a preflight apart."""
    torch.set_num_threads(threads or 1)
    config = load_config(path, {} if path else {"device": "cpu", "capture.max_size": 8 if quick else 16})
    model = build_model(config)
    manager = CaptureManager(model, config, progress=False)
    if manager.backend.name != "emulated":
        raise SystemExit("bench_capture --apart: the emulated backend's recording is what runs the checks")
    manager.capture()  # the process's own lazy set-up, not timed
    backend = manager.backend
    seconds: dict[str, list[float]] = {"in the recording": [], "preflight apart": []}
    for index in range(2 * rounds):
        kind = ("in the recording", "preflight apart")[(index + index // 2) % 2]  # which goes first alternates
        backend.checks_in_capture = kind == "in the recording"
        model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone(), requires_grad=False)
        report = manager.capture()
        if not all(r.verified for r in report.records):
            raise SystemExit("bench_capture: a key was not verified")
        seconds[kind].append(report.total_seconds)
    vars(backend).pop("checks_in_capture", None)
    ratio = np.array(seconds["in the recording"]) / np.array(seconds["preflight apart"])
    print(
        f"re-capture passes, the unsafe-op checks in the recording vs a checked preflight apart per key, "
        f"{len(report.records)} graphs, {rounds} pairs interleaved, {torch.get_num_threads()} thread(s)"
    )
    print(f"{'checks':<17} {'median s':>9} {'min-max s':>13}")
    for kind, values in seconds.items():
        print(f"{kind:<17} {np.median(values):>9.3f} {min(values):>6.3f}-{max(values):<6.3f}")
    print(f"in the recording / apart per pair: median {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")
    return 0
