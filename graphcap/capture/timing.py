"""Per-key step timing: eager forward vs graph replay, through the manager's real step path.

Used by `graphcap bench`, `tools/bench_capture.py` and `tools/gpu_check.py`. Both sides
include staging and the invariant checks, so the numbers are what an engine pays per step.

Timing runs through `torch.utils.benchmark.Timer` (it synchronizes the accelerator around
each sample and keeps torch's thread count fixed), one step per sample, the two sides
interleaved so that both see the same background load. The spread comes with the median:
on a busy host one outlier must not pass for a speedup, so a key whose interquartile range
exceeds 10% of its median (torch.utils.benchmark's own warning threshold) is `noisy`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphcap.keys import GraphKey
from graphcap.workload import fill_batch

__all__ = ["NOISY_IQR", "SPEEDUP_REPS", "KeyTiming", "Spread", "replay_speedup", "time_key"]

SPEEDUP_REPS = 3
"""Runs of each side `replay_speedup` times at capture (the median of each is compared)."""

NOISY_IQR = 0.1
"""A side is noisy when its interquartile range is above this fraction of its median."""


@dataclass(frozen=True, slots=True)
class Spread:
    """Milliseconds per step of one side: median, 10th/90th percentiles, interquartile range."""

    median: float
    p10: float
    p90: float
    iqr: float
    samples: int

    @property
    def noisy(self) -> bool:
        return self.median > 0 and self.iqr / self.median > NOISY_IQR

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "iqr": self.iqr, "samples": self.samples}

    @classmethod
    def of(cls, samples_ms: list[float]) -> Spread:
        ordered = sorted(samples_ms)
        return cls(
            _quantile(ordered, 0.5),
            _quantile(ordered, 0.1),
            _quantile(ordered, 0.9),
            _quantile(ordered, 0.75) - _quantile(ordered, 0.25),
            len(ordered),
        )


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's and torch's default)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class KeyTiming:
    """Step time of one key: each side's spread; `eager_ms`/`replay_ms` are the medians."""

    key: GraphKey
    eager: Spread
    replay: Spread

    @property
    def eager_ms(self) -> float:
        return self.eager.median

    @property
    def replay_ms(self) -> float:
        return self.replay.median

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.replay_ms if self.replay_ms > 0 else float("inf")

    @property
    def speedup_range(self) -> tuple[float, float]:
        """Speedup from the slow end to the fast end of the two spreads (p10/p90 against p90/p10)."""
        low = self.eager.p10 / self.replay.p90 if self.replay.p90 > 0 else float("inf")
        high = self.eager.p90 / self.replay.p10 if self.replay.p10 > 0 else float("inf")
        return low, high

    @property
    def noisy(self) -> bool:
        return self.eager.noisy or self.replay.noisy

    def to_dict(self) -> dict[str, object]:
        return {"eager_ms": self.eager.to_dict(), "replay_ms": self.replay.to_dict(), "noisy": self.noisy}


def time_key(manager, key: GraphKey, steps: int = 20, warmup: int = 3) -> KeyTiming | None:
    """Time `manager.eager` and `manager.execute` on a batch that fills `key`, `steps` samples each.

    None when no real batch reaches `key` (a mixed key of one token: one token is always
    a uniform decode step) or `key` is not captured.
    """
    import torch
    from torch.utils.benchmark import Timer

    batch = fill_batch(key, manager.config)
    if manager.dispatch(batch) != key:
        return None
    threads = torch.get_num_threads()  # Timer's default of one thread would not be the engine's setting
    timers = {
        side: Timer("step(batch)", globals={"step": step, "batch": batch}, num_threads=threads)
        for side, step in (("eager", manager.eager), ("replay", manager.execute))
    }
    samples: dict[str, list[float]] = {side: [] for side in timers}
    with manager.uncounted():  # benchmark steps are not engine traffic
        for timer in timers.values():
            if warmup > 0:
                timer.timeit(warmup)
        for _ in range(steps):
            for side, timer in timers.items():
                samples[side].append(timer.timeit(1).raw_times[0] * 1e3)
    return KeyTiming(key, Spread.of(samples["eager"]), Spread.of(samples["replay"]))


def replay_speedup(
    replay: Callable[[], Any],
    eager: Callable[[], Any],
    backend: Any,
    reps: int = SPEEDUP_REPS,
    timer: Callable[[], float] | None = None,
) -> float:
    """Eager time over replay time of one batch: the medians of `reps` runs of each side, interleaved.

    Timed with CUDA events on the `cuda` backend, else with `timer` (default `time.perf_counter`)
    around a `backend.synchronize()` on each side of the run. What capture records as a key's
    `speedup` (`capture.min_speedup` compares with it); `inf` when the replay took no measurable time.
    """
    samples: dict[str, list[float]] = {"replay": [], "eager": []}
    for _ in range(reps):
        for side, run in (("replay", replay), ("eager", eager)):
            samples[side].append(_elapsed(run, backend, timer))
    replay_s, eager_s = statistics.median(samples["replay"]), statistics.median(samples["eager"])
    return eager_s / replay_s if replay_s > 0 else float("inf")


def _elapsed(run: Callable[[], Any], backend: Any, timer: Callable[[], float] | None) -> float:
    """Seconds `run()` took on the device (CUDA events) or by `timer` between two synchronizations."""
    if timer is None and backend.name == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    timer = timer or time.perf_counter
    backend.synchronize()
    began = timer()
    run()
    backend.synchronize()
    return timer() - began
