"""Capture passes for `bench_capture.py`: where a re-capture pass goes (`where_a_pass_goes`); `--pass-threads`:
re-capture passes at one and two torch threads, interleaved in pairs in one process; and (`--apart`) re-capture
passes with the emulated backend's checks in its recording (the
default) against passes that run a separate checked preflight per key first (`checks_in_capture` off, as a
backend whose capture checks nothing does), interleaved in pairs in one process (which goes first alternates)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from graphcap import CaptureManager, load_config
from graphcap.models import build_model
from graphcap.probe import probe_batches_run, probe_fills
from graphcap.testing import time_key
from graphcap.workload import fill_batch


def checks_apart(path: str | None, rounds: int, quick: bool, threads: int | None) -> int:
    """Seconds of re-captures (after a weight swap) with the checks in the recording vs in a preflight apart."""
    torch.set_num_threads(threads or 1)
    manager, model = _emulated_manager(path, quick, "--apart")
    backend = manager.backend

    def side(kind: str) -> None:
        backend.checks_in_capture = kind == "in the recording"

    seconds, graphs = _interleaved(manager, model, ("in the recording", "preflight apart"), side, rounds)
    vars(backend).pop("checks_in_capture", None)
    title = "the unsafe-op checks in the recording vs a checked preflight apart per key"
    _table(title, seconds, graphs, rounds, f"{torch.get_num_threads()} thread(s)", "checks")
    return 0


def pass_threads(path: str | None, rounds: int, quick: bool) -> int:
    """Seconds of re-captures at one and at two torch threads (`EMULATED_CAPTURE_THREADS`), interleaved."""
    import graphcap.capture.capturer as driver

    manager, model = _emulated_manager(path, quick, "--pass-threads")
    if manager.config.capture.num_threads is not None:
        raise SystemExit("bench_capture --pass-threads: the config sets capture.num_threads; drop it")
    default = driver.EMULATED_CAPTURE_THREADS

    def side(kind: str) -> None:
        driver.EMULATED_CAPTURE_THREADS = int(kind.split()[0])

    try:
        seconds, graphs = _interleaved(manager, model, ("1 thread", "2 threads"), side, rounds)
    finally:
        driver.EMULATED_CAPTURE_THREADS = default
    _table("at 1 vs 2 torch threads (EMULATED_CAPTURE_THREADS)", seconds, graphs, rounds, "", "threads")
    return 0


def _emulated_manager(path: str | None, quick: bool, flag: str) -> tuple[CaptureManager, torch.nn.Module]:
    config = load_config(path, {} if path else {"device": "cpu", "capture.max_size": 8 if quick else 16})
    model = build_model(config)
    manager = CaptureManager(model, config, progress=False)
    if manager.backend.name != "emulated":
        raise SystemExit(f"bench_capture {flag}: times the emulated backend's passes; the config picks another")
    manager.capture()  # the process's own lazy set-up, not timed
    return manager, model


def _interleaved(manager, model, kinds: tuple[str, str], side, rounds: int) -> tuple[dict[str, list[float]], int]:
    """Re-captures after a weight swap, `side(kind)` set before each, in pairs (which goes first alternates)."""
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for index in range(2 * rounds):
        kind = kinds[(index + index // 2) % 2]
        side(kind)
        model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone(), requires_grad=False)
        report = manager.capture()
        if not all(r.verified for r in report.records):
            raise SystemExit("bench_capture: a key was not verified")
        seconds[kind].append(report.total_seconds)
    return seconds, len(report.records)


def _table(title: str, seconds: dict[str, list[float]], graphs: int, rounds: int, where: str, column: str) -> None:
    first, second = seconds
    ratio = np.array(seconds[first]) / np.array(seconds[second])
    print(f"re-capture passes, {title}, {graphs} graphs, {rounds} pairs interleaved" + (f", {where}" if where else ""))
    print(f"{column:<17} {'median s':>9} {'min-max s':>13}")
    for kind, values in seconds.items():
        print(f"{kind:<17} {np.median(values):>9.3f} {min(values):>6.3f}-{max(values):<6.3f}")
    print(f"{first} / {second} per pair: median {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")


def at_threads(manager: CaptureManager, keys, steps: int, threads: int) -> dict:
    """`time_key` of each of `keys` with torch at `threads` threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {key: time_key(manager, key, steps=steps) for key in keys}
    finally:
        torch.set_num_threads(before)


CAPTURE_GOAL = 1.5
"""The goal: a capture pass within 1.5x the four eager forwards per key it must run anyway."""


def where_a_pass_goes(manager: CaptureManager, rounds: int, threads: int) -> None:
    """Re-capture passes timed whole and per step (preflight, plain warmups, capture, verification), each followed
    by an eager step of every key at the pass's `threads` (the batch that fills the key: `fill_batch`), so each
    round has its own unit: that round's eager steps. Per round the pass over the four forwards per key, and over
    the forwards it must run with its fill-level probes (the four, a replay per fill level and an eager run per
    distinct probe batch, each at its key's eager step); medians and min-max over the rounds, beside the goal."""
    from _gpu_llama import KeyTimes

    registry, config = manager.registry, manager.config
    max_model_len = config.kv_cache.max_model_len
    shapes = {registry.capture_shape(key): key for key in registry.capture_order()}
    runs = probe_batches_run(shapes, max_model_len=max_model_len)
    probes = {key: len(probe_fills(shape, max_model_len=max_model_len)) + runs[shape] for shape, key in shapes.items()}
    batches = {key: fill_batch(key, config) for key in probes}
    walls, steps, units, musts = [], {}, [], []
    for _ in range(rounds):
        times = KeyTimes(manager)
        with times.installed():
            began = time.perf_counter()
            manager.capture()
            walls.append(time.perf_counter() - began)
        totals: dict[str, float] = {}
        for row in times.table().values():
            for step, seconds in row.items():
                totals[step] = totals.get(step, 0.0) + seconds
        for step, seconds in totals.items():
            steps.setdefault(step, []).append(seconds)
        eager = _eager_steps(manager, batches, threads)
        units.append(sum(eager.values()))
        musts.append(4 + sum(probes[key] * seconds for key, seconds in eager.items()) / units[-1])
    unit = statistics.median(units)
    wall = statistics.median(walls)
    order = ("preflight", "warmups", "capture", "verification")  # a step that never ran shows 0
    parts = {step: statistics.median(steps.get(step, [0.0])) for step in (*order, *steps.keys() - set(order))}
    parts["outside the keys (GC, report, set-up)"] = wall - sum(parts.values())
    print(
        f"where a re-capture pass goes ({rounds} passes, each followed by an eager step of every key, the median of "
        f"three: the unit, median {unit * 1e3:.1f} ms, {min(units) * 1e3:.1f}-{max(units) * 1e3:.1f})"
    )
    print(f"{'part':<40} {'seconds':>8} {'units':>6}")
    for step, seconds in parts.items():
        print(f"{step:<40} {seconds:>8.3f} {seconds / unit:>6.2f}")
    print(
        f"{'whole pass (median; min-max)':<40} {wall:>8.3f} {wall / unit:>6.2f}   {min(walls):.3f}-{max(walls):.3f} s"
    )
    if "preflight" not in steps:
        print(f"preflight: in the {manager.backend.name} backend's recording (its checks run in capture)")
    four = np.array(walls) / np.array(units) / 4
    print(
        f"capture pass / 4 eager forwards per key, per round: {np.median(four):.2f}x "
        f"({four.min():.2f}-{four.max():.2f}; goal <= {CAPTURE_GOAL}x); the four: the checked preflight, a warmup, "
        "the recorded capture, the verification's eager run"
    )
    must = np.array(walls) / (np.array(units) * np.array(musts))
    print(
        f"capture pass / the forwards it must run with its probes, per round ({statistics.median(musts):.2f} units: "
        "the four, a replay per fill level and an eager run per distinct probe batch): "
        f"{np.median(must):.2f}x ({must.min():.2f}-{must.max():.2f})"
    )


def _eager_steps(manager: CaptureManager, batches: dict, threads: int) -> dict:
    """Seconds of a `manager.eager` step of each key's batch at `threads` torch threads (restored after): the median
    of three."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    seconds = {}
    try:
        with manager.uncounted():  # benchmark steps are not engine traffic
            for key, batch in batches.items():
                samples = []
                for _ in range(3):
                    began = time.perf_counter()
                    manager.eager(batch)
                    samples.append(time.perf_counter() - began)
                seconds[key] = statistics.median(samples)
    finally:
        torch.set_num_threads(before)
    return seconds
