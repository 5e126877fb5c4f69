"""Capture orchestration overhead, and per-step `execute` vs `eager`.

Table 1, per graph: the capture wall time (staging, invariants, warmups, capture,
verification) over the time of the forwards it had to run anyway
(`1 preflight + num_warmups + 1 capture + 1 verify`, each at the median eager step time). A ratio near
1 means graphcap adds little beyond the forwards themselves. Below it, re-capture passes timed per part, over
the four forwards per key, and over the forwards a pass must run with its fill-level probes (the four, a replay
per fill level, `graphcap.probe.probe_fills`, and an eager run per distinct probe batch, which the keys probing
the same counts share), in eager steps at the threads the pass runs at (`tools/_capture_passes.py`).

Table 2: median ms per step of `CaptureManager.execute` (graph replay) and `.eager` at
sizes 1, 8 and 64, through the full step path (staging and invariants included).

`--padding` prints instead the expected padded-token waste of sizes chosen from traffic
(`graphcap.sizing.choice`) against vLLM's default ladder (51 sizes up to 512, which is also
`default_capture_sizes(512)`), over the traffic shapes of `graphcap.testing.traffic` (a
chunked-prefill scheduler with a 512-token budget), three seeds each. No timing: the numbers
are exact for the histograms.

`--held-out` prints, per traffic shape and seed, the waste of sizes chosen from traffic
(`graphcap.sizing.held_out.choose_held_out`) in sample and held out (chosen on half the steps,
scored on the other, both ways), at 30 graphs and at the ladder's 51, beside the default ladder's
held-out waste at the same number of graphs (the goal: never above it). No timing.

`--recapture` times, per round on a fresh manager, its first capture, a re-capture after a weight
swap (`lm_head` replaced, as an RL weight sync does) and a capture after `release()` (a wake-up),
side by side, rounds interleaved; a first warm-up round is dropped (the process's own lazy set-up).

    python tools/bench_capture.py [--config PATH] [--steps N] [--threads N] [--quick]
    python tools/bench_capture.py --padding [--seeds N]
    python tools/bench_capture.py --held-out [--seeds N]
    python tools/bench_capture.py --recapture [--rounds N] [--config PATH] [--quick]
    python tools/bench_capture.py --recapture --gc-full   # ... and re-captures with a full collection after
    python tools/bench_capture.py --lazy [--rounds N] [--config PATH] [--quick]
    python tools/bench_capture.py --fills [--rounds N] [--config PATH] [--quick]
    python tools/bench_capture.py --apart [--rounds N] [--config PATH] [--quick]   # tools/_capture_passes.py
    python tools/bench_capture.py --pass-threads [--rounds N] [--config PATH] [--quick]

`--fills` times re-captures (after a weight swap) whose verification replays a probe batch at every
fill level of each key (`graphcap.probe.probe_fills`: one real token, about half, all but one)
against ones that replay the middle level only, interleaved in pairs (which goes first alternates).

`--lazy` times, per round, the time to the first served step (manager construction, `capture()`,
one decode step of 3 requests; the model is built before the clock starts) with
`capture.strategy: upfront` and `lazy`, the two interleaved in each round (which goes first
alternates), and the lazy manager's `capture_pending()` of every key after that step.

`--gc-full` adds re-captures whose collection after the pass walks the whole heap (as before the
young-generation collection), interleaved with ones that walk the young generations only.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
import torch
from _capture_passes import checks_apart, pass_threads, where_a_pass_goes

import graphcap.capture.capturer as driver_module
from graphcap import CaptureManager, load_config
from graphcap.models import build_model
from graphcap.sizing.choice import SizeConstraints, choose_sizes
from graphcap.sizing.sizes import CaptureSizes
from graphcap.testing import time_key
from graphcap.testing.traffic import TRAFFIC_SHAPES, traffic_histogram

VLLM_LADDER = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
"""vLLM's default `cudagraph_capture_sizes` up to 512 (51 sizes)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: the embedded default on the CPU)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per key and side")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 8, 3 steps (a smoke run)")
    parser.add_argument("--padding", action="store_true", help="padding of chosen vs default ladders, then exit")
    parser.add_argument("--seeds", type=int, default=3, help="with --padding: seeds per traffic shape")
    parser.add_argument("--held-out", action="store_true", help="in-sample vs held-out waste of chosen sizes")
    parser.add_argument("--recapture", action="store_true", help="first capture vs re-capture vs wake, then exit")
    parser.add_argument("--rounds", type=int, default=5, help="with --recapture: timed rounds")
    parser.add_argument("--gc-full", action="store_true", help="with --recapture: also a full collection after")
    parser.add_argument("--lazy", action="store_true", help="time to the first served step, lazy vs upfront")
    parser.add_argument("--fills", action="store_true", help="verification at every fill level vs one, then exit")
    parser.add_argument("--apart", action="store_true", help="checks in the recording vs a preflight apart")
    parser.add_argument("--pass-threads", action="store_true", help="emulated passes at 1 vs 2 threads")
    args = parser.parse_args()
    if args.apart:
        return checks_apart(args.config, 2 if args.quick else args.rounds, args.quick, args.threads)
    if args.pass_threads:
        return pass_threads(args.config, 2 if args.quick else args.rounds, args.quick)
    if args.fills:
        return fill_levels(args.config, 2 if args.quick else args.rounds, args.quick, args.threads)
    if args.padding:
        return padding(args.seeds)
    if args.held_out:
        return held_out(args.seeds)
    if args.lazy:
        return first_step(args.config, 2 if args.quick else args.rounds, args.quick, args.threads)
    if args.recapture:
        rounds = 2 if args.quick else args.rounds
        status = recapture(args.config, rounds, args.quick, args.threads)
        if args.gc_full:
            status = status or collections(args.config, rounds, args.quick, args.threads)
        return status
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {} if args.config else {"device": "cpu"}
    if args.threads:  # the pass too (capture.num_threads), not only the eager steps
        overrides["capture.num_threads"] = args.threads
    if args.quick:
        overrides["capture.max_size"] = 8
    steps = 3 if args.quick else args.steps
    config = load_config(args.config, overrides)
    manager = CaptureManager(build_model(config), config, progress=False)
    report = manager.capture()
    # The checked preflight, the plain warmups, the capture and the verification's eager run.
    forwards = 1 + config.capture.num_warmups + 1 + int(config.checks.verify_replay)
    timings = {r.key: time_key(manager, r.key, steps=steps) for r in report.captured}

    print(f"capture overhead ({report.backend} backend on {report.device}, {torch.get_num_threads()} threads)")
    print(f"{'key':<8} {'tokens':>6} {'reqs':>5} {'capture ms':>10} {'forwards':>8} {'eager ms':>9} {'ratio':>6}")
    ratios = []
    for record in report.captured:
        timing = timings[record.key]
        if timing is None:
            continue
        ratio = record.capture_seconds * 1e3 / (forwards * timing.eager_ms)
        ratios.append(ratio)
        kind = "uniform" if record.key.uniform else "mixed"
        print(
            f"{kind:<8} {record.key.num_tokens:>6} {record.key.num_reqs:>5} {record.capture_seconds * 1e3:>10.1f} "
            f"{forwards:>8} {timing.eager_ms:>9.3f} {ratio:>5.2f}x"
        )
    ratios.sort()
    print(
        f"median ratio {ratios[len(ratios) // 2]:.2f}x over {len(ratios)} graphs; "
        f"total capture {report.total_seconds:.2f} s"
    )
    print()
    # The unit of the pass: eager steps at the threads the pass runs at (an emulated pass sets its own).
    threads = torch.get_num_threads()
    if report.backend == "emulated":
        threads = config.capture.num_threads or driver_module.EMULATED_CAPTURE_THREADS
    print(f"(the pass's unit: eager steps at the pass's {threads} thread(s))")
    where_a_pass_goes(manager, 3 if args.quick else args.rounds, threads)
    print()
    print("per step, median ms (staging + invariants + forward or replay)")
    print(f"{'size':>5} {'key':<8} {'execute ms':>10} {'eager ms':>9} {'speedup':>8}")
    for size in (1, 8, 64):
        for key, timing in sorted(timings.items(), key=lambda kv: (kv[0].num_tokens, not kv[0].uniform)):
            if key.num_tokens == size and timing is not None:
                kind = "uniform" if key.uniform else "mixed"
                print(f"{size:>5} {kind:<8} {timing.replay_ms:>10.3f} {timing.eager_ms:>9.3f} {timing.speedup:>7.2f}x")
    return 0


def first_step(path: str | None, rounds: int, quick: bool, threads: int | None) -> int:
    """Seconds from manager construction to the first served step, upfront against lazy, rounds interleaved."""
    import time

    from graphcap import StepBatch

    torch.set_num_threads(threads or 1)
    overrides = {} if path else {"device": "cpu", "capture.max_size": 8 if quick else 64}
    batch = StepBatch([1, 1, 1], [5, 9, 17], [11, 42, 7], np.array([[1, 0, 0], [2, 6, 0], [3, 4, 5]]))
    seconds: dict[str, list[float]] = {"upfront": [], "lazy": [], "lazy: capture_pending()": []}
    configs = {kind: load_config(path, {**overrides, "capture.strategy": kind}) for kind in ("upfront", "lazy")}
    num_keys = 0
    for index in range(rounds + 1):  # round 0 warms the process up and is dropped
        for kind in ("upfront", "lazy") if index % 2 else ("lazy", "upfront"):
            model = build_model(configs[kind])
            began = time.perf_counter()
            manager = CaptureManager(model, configs[kind], progress=False)
            manager.capture()
            manager.execute(batch)
            served = time.perf_counter() - began
            if kind == "lazy":
                began = time.perf_counter()
                num_keys = manager.capture_pending()
                pending = time.perf_counter() - began
            if index:
                seconds[kind].append(served)
                if kind == "lazy":
                    seconds["lazy: capture_pending()"].append(pending)
            manager.release()
    where = f"{configs['lazy'].device}, {torch.get_num_threads()} thread(s), {num_keys} keys, {rounds} rounds"
    print(f"time to the first served step ({where})")
    print(f"{'strategy':<24} {'median s':>9} {'min-max s':>13} {'/ upfront (per round)':>22}")
    for kind, values in seconds.items():
        values = np.array(values)
        ratios = values / np.array(seconds["upfront"])
        ratio = "" if kind == "upfront" else f"{np.median(ratios):.3f} ({ratios.min():.3f}-{ratios.max():.3f})"
        print(f"{kind:<24} {np.median(values):>9.3f} {values.min():>6.3f}-{values.max():<6.3f} {ratio:>22}")
    return 0


def recapture(path: str | None, rounds: int, quick: bool, threads: int | None) -> int:
    """First capture, re-capture after a weight swap, capture after release(): seconds per round, side by side."""
    torch.set_num_threads(threads or 1)
    overrides = {} if path else {"device": "cpu", "capture.max_size": 8 if quick else 16}
    config = load_config(path, overrides)
    kinds = ("first", "after swap", "after release")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for index in range(rounds + 1):  # round 0 warms the process up and is dropped
        model = build_model(config)
        manager = CaptureManager(model, config, progress=False)
        first = manager.capture()
        with torch.no_grad():
            model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone(), requires_grad=False)
        swapped = manager.capture()
        manager.release()
        woken = manager.capture()
        if swapped.recapture["after"] != "capture()" or woken.recapture["after"] != "release()":
            raise SystemExit("bench_capture: a re-capture was not reported as one")
        if index:
            for kind, report in zip(kinds, (first, swapped, woken)):
                seconds[kind].append(report.total_seconds)
        manager.release()
    ratios = {kind: np.array(seconds[kind]) / np.array(seconds["first"]) for kind in kinds[1:]}
    print(
        f"capture passes ({first.backend} backend on {first.device}, {torch.get_num_threads()} thread(s), "
        f"{len(first.captured)} graphs, {rounds} rounds after a warm-up round)"
    )
    print(f"{'pass':<14} {'median s':>9} {'min-max s':>13} {'/ first (per round)':>20}")
    for kind in kinds:
        values = np.array(seconds[kind])
        ratio = (
            ""
            if kind == "first"
            else f"{np.median(ratios[kind]):.2f} ({ratios[kind].min():.2f}-{ratios[kind].max():.2f})"
        )
        print(f"{kind:<14} {np.median(values):>9.2f} {values.min():>6.2f}-{values.max():<6.2f} {ratio:>20}")
    print("kept by every re-capture: " + ", ".join(woken.recapture["reused"]))
    return 0


def collections(path: str | None, rounds: int, quick: bool, threads: int | None) -> int:
    """Re-captures after a weight swap: young-generation collection after the pass vs a full one, interleaved."""
    torch.set_num_threads(threads or 1)
    config = load_config(path, {} if path else {"device": "cpu", "capture.max_size": 8 if quick else 16})
    model = build_model(config)
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    seconds: dict[str, list[float]] = {"young": [], "full": []}
    young = driver_module.gc_frozen
    for index in range(2 * rounds):
        kind = ("young", "full")[index % 2]
        driver_module.gc_frozen = young if kind == "young" else functools.partial(young, after=2)
        model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone(), requires_grad=False)
        seconds[kind].append(manager.capture().total_seconds)
    driver_module.gc_frozen = young
    ratio = np.array(seconds["young"]) / np.array(seconds["full"])
    print()
    print(f"re-capture after a weight swap, collection after the pass ({rounds} pairs, interleaved)")
    print(f"{'collection':<10} {'median s':>9} {'min-max s':>13}")
    for kind, values in seconds.items():
        print(f"{kind:<10} {np.median(values):>9.2f} {min(values):>6.2f}-{max(values):<6.2f}")
    print(f"young / full per pair: median {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")
    return 0


def fill_levels(path: str | None, rounds: int, quick: bool, threads: int | None) -> int:
    """Re-captures after a weight swap verified at every fill level vs at one (the middle level), interleaved."""
    import graphcap.capture.references as probing

    torch.set_num_threads(threads or 1)
    config = load_config(path, {} if path else {"device": "cpu", "capture.max_size": 8 if quick else 16})
    model = build_model(config)
    manager = CaptureManager(model, config, progress=False)
    manager.capture()  # the process's own lazy set-up, not timed
    every = probing.probe_fills

    def middle(key, *, max_model_len):
        fills = every(key, max_model_len=max_model_len)
        return fills[len(fills) // 2 : len(fills) // 2 + 1]

    seconds: dict[str, list[float]] = {"every level": [], "one level": []}
    for index in range(2 * rounds):
        kind = ("every level", "one level")[(index + index // 2) % 2]  # which goes first alternates per pair
        probing.probe_fills = every if kind == "every level" else middle
        model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone(), requires_grad=False)
        report = manager.capture()
        if not all(r.verified for r in report.records):
            raise SystemExit("bench_capture: a key was not verified")
        seconds[kind].append(report.total_seconds)
    probing.probe_fills = every
    ratio = np.array(seconds["every level"]) / np.array(seconds["one level"])
    probes = sum(len(every(manager.registry.capture_shape(r.key), max_model_len=config.kv_cache.max_model_len))
                 for r in report.records)  # fmt: skip
    print(
        f"capture passes verified at every fill level ({probes} probe batches) vs one ({len(report.records)}), "
        f"{len(report.records)} graphs, {rounds} pairs interleaved, {torch.get_num_threads()} thread(s)"
    )
    print(f"{'verification':<12} {'median s':>9} {'min-max s':>13}")
    for kind, values in seconds.items():
        print(f"{kind:<12} {np.median(values):>9.2f} {min(values):>6.2f}-{max(values):<6.2f}")
    print(f"every / one per pair: median {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")
    return 0


def padding(seeds: int) -> int:
    """Waste of the vLLM ladder and of chosen sizes per traffic shape and seed (and the fewest
    chosen graphs that waste no more than the ladder, and at most 5%)."""
    ladder = CaptureSizes(VLLM_LADDER, 512)
    bound = SizeConstraints(512)
    print("expected padded-token waste over traffic histograms (steps up to 512 tokens)")
    header = f"{'shape':<14} {'seed':>4} {'steps':>5} {'counts':>6} {'ladder 51':>9}"
    print(f"{header} {'chosen 30':>9} {'chosen 51':>9} {'graphs = ladder':>15} {'graphs <= 5%':>12}")
    worst = 0.0
    cases = [(shape, str(seed), traffic_histogram(shape, seed)) for shape in TRAFFIC_SHAPES for seed in range(seeds)]
    # Two limits of the optimum itself: every count equally often, and as many tokens at each count.
    cases.append(("synthetic 1", "-", dict.fromkeys(range(1, 513), 1.0)))
    cases.append(("synthetic 1/n", "-", {n: 1 / n for n in range(1, 513)}))
    for shape, seed, histogram in cases:
        wastes = {n: choose_sizes(histogram, n, bound).waste for n in range(1, len(VLLM_LADDER) + 1)}
        baseline = ladder.expected_waste(histogram)
        as_good = min(n for n, w in wastes.items() if w <= baseline + 1e-12)
        within = min((n for n, w in wastes.items() if w <= 0.05), default=None)
        if seed != "-":
            worst = max(worst, wastes[30])
        print(
            f"{shape:<14} {seed:>4} {sum(histogram.values()):>5.0f} {len(histogram):>6} {baseline:>9.2%} "
            f"{wastes[30]:>9.2%} {wastes[51]:>9.2%} {as_good:>15} {within or '> 51':>12}"
        )
    print("synthetic rows: every count 1-512 with weight 1, and with weight 1/n (steps need not be whole)")
    print(f"worst waste with 30 chosen graphs (60% of the ladder's 51) on the traffic shapes: {worst:.2%}")
    return 0


def held_out(seeds: int) -> int:
    """In-sample and held-out waste of chosen sizes at 30 and 51 graphs, beside the ladder's held out."""
    from graphcap.sizing.held_out import choose_held_out

    bound = SizeConstraints(512)
    print("padded-token waste of sizes chosen from traffic: in sample, and held out (chosen on half the steps,")
    print("scored on the other, both ways), beside the default ladder's held out at the same number of graphs")
    header = f"{'shape':<14} {'seed':>4} {'N':>3} {'in sample':>9} {'held out':>8} {'ladder':>7} {'way':<8}"
    print(header)
    worst = 0.0  # held out minus the ladder's: the goal is <= 0
    for shape in TRAFFIC_SHAPES:
        for seed in range(seeds):
            histogram = traffic_histogram(shape, seed)
            for graphs in (30, len(VLLM_LADDER)):
                held = choose_held_out(histogram, graphs, bound)
                ours, ladder = held.held_out[held.way], held.held_out["ladder"]
                worst = max(worst, ours - ladder)
                row = f"{shape:<14} {seed:>4} {graphs:>3} {held.in_sample:>9.2%} {ours:>8.2%} {ladder:>7.2%}"
                print(f"{row} {held.way:<8}")
    print(f"largest held-out waste above the ladder's at the same N: {worst:.2%} (goal <= 0.00%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
