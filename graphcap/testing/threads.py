"""Thread experiments: several threads step one manager; a log proves staging and replay never interleave."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from graphcap.batch import StepBatch
from graphcap.manager import CaptureManager

__all__ = [
    "NUM_THREADS",
    "STEPS_PER_THREAD",
    "EventLog",
    "NoLock",
    "expected_outputs",
    "run_threads",
    "thread_batches",
]

NUM_THREADS = 3
STEPS_PER_THREAD = 40


def thread_batches(thread: int) -> list[StepBatch]:
    """Steps of one thread over its own KV blocks: decodes, a mixed step, an eager prefill.

    Each is self-contained (`seq_lens == query_lens`: it writes every KV slot it reads), so
    its output does not depend on what ran before and is checked bit for bit.
    """
    base = 1 + 20 * thread
    rng = np.random.default_rng(thread)

    def ids(n):
        return rng.integers(0, 128, n)

    return [
        StepBatch([1, 1], [1, 1], ids(2), [[base], [base + 1]]),  # uniform, 2 tokens
        StepBatch([2, 1], [2, 1], ids(3), [[base + 2], [base + 3]]),  # mixed, pads to 4
        StepBatch([1] * 5, [1] * 5, ids(5), [[base + 4 + i] for i in range(5)]),  # uniform, pads to 8
        StepBatch([7, 5], [7, 5], ids(12), [[base + 9, base + 10], [base + 11, base + 12]]),  # eager
    ]


def expected_outputs(manager: CaptureManager) -> dict[tuple[int, int], torch.Tensor]:
    """Every thread's steps, run one at a time: the reference for the threaded runs."""
    return {
        (thread, i): cast(torch.Tensor, manager.execute(batch)).clone()
        for thread in range(NUM_THREADS)
        for i, batch in enumerate(thread_batches(thread))
    }


class EventLog:
    """While entered, records (kind, thread) for every staging and every replay or eager run.

    Patches the manager's buffers, forward and graphs (restored on exit) and sleeps briefly
    after each staging to invite a thread switch between staging and replay.
    """

    def __init__(self, manager: CaptureManager, *, pause: float = 2e-4) -> None:
        self.manager = manager
        self.pause = pause
        self.events: list[tuple[str, str]] = []
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def __enter__(self) -> EventLog:
        manager = self.manager
        self._patch(manager.buffers, "stage", "stage", pause=True)
        self._patch(manager.capturer.parts, "forward", "run")  # the forward every step and capture runs
        for graph in manager.graphs.values():
            self._patch(graph, "replay", "run")
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, had, old in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()

    def _patch(self, obj: Any, name: str, kind: str, *, pause: bool = False) -> None:
        fn = getattr(obj, name)
        self._undo.append((obj, name, name in vars(obj), vars(obj).get(name)))

        def wrapped(*args, **kwargs):
            self.events.append((kind, threading.current_thread().name))
            result = fn(*args, **kwargs)
            if pause:
                time.sleep(self.pause)
            return result

        setattr(obj, name, wrapped)

    def interleavings(self) -> int:
        """Steps whose staging and run were not back to back in one thread."""
        events, bad = self.events, len(self.events) % 2
        for i in range(0, len(events) - 1, 2):
            (kind_a, thread_a), (kind_b, thread_b) = events[i], events[i + 1]
            bad += not (kind_a == "stage" and kind_b == "run" and thread_a == thread_b)
        return bad


def run_threads(
    manager: CaptureManager, expected: dict, *, seed: int = 0, extra: Callable[[], object] | None = None
) -> tuple[int, list[BaseException]]:
    """NUM_THREADS threads run their steps in random order, reading each result under
    `manager.lock`; `extra` runs in one more thread. Returns (mismatched outputs, errors)."""
    mismatches = [0]
    errors: list[BaseException] = []
    start = threading.Barrier(NUM_THREADS + (extra is not None))

    def worker(thread: int) -> None:
        batches = thread_batches(thread)
        order = np.random.default_rng(1000 * seed + thread).integers(0, len(batches), STEPS_PER_THREAD)
        start.wait()
        try:
            for i in order:
                with manager.lock:
                    out = cast(torch.Tensor, manager.execute(batches[i])).clone()
                if not torch.equal(out, expected[thread, int(i)]):
                    mismatches[0] += 1
        except BaseException as exc:  # reported by the caller, not lost in the thread
            errors.append(exc)

    def side(run: Callable[[], object]) -> None:
        start.wait()
        try:
            run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,), name=f"worker-{t}") for t in range(NUM_THREADS)]
    if extra is not None:
        threads.append(threading.Thread(target=side, args=(extra,), name="side"))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if any(t.is_alive() for t in threads):
        raise AssertionError("a thread hung")
    return mismatches[0], errors


class NoLock:
    """Stands in for the manager's lock in the control experiment (steps then interleave)."""

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
