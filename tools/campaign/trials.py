"""What the campaign counts: its scale (full or quick), a trial, a table row."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@dataclasses.dataclass
class Scale:
    random_docs: int
    combos: int
    plans: int
    faults: int
    report_writes: int
    stress_seeds: int
    stress_steps: int
    thread_rounds: int
    control_rounds: int
    cli_cases_per_area: int | None
    """None: every case of `cli_cases.py` (the quick run takes the first of each area)."""
    interrupts: int
    dp_worlds: tuple[int, ...]
    lifecycle_seeds: int
    lifecycle_steps: int
    lifecycle_cycles: int
    every_move_at_every_level: bool = True
    """False (the quick run): each way of moving a static input at one invariant level, the levels in turn."""


FULL = Scale(2000, 300, 5000, 8, 6, 4, 2500, 20, 5, None, 12, (2, 3), 3, 60, 10)
QUICK = Scale(30, 10, 100, 1, 2, 1, 60, 1, 1, 1, 1, (2,), 1, 24, 2, False)


@dataclasses.dataclass
class Row:
    area: str
    what: str
    count: int
    outcome: str
    passed: int
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.passed == self.count and not self.failures


class Tally:
    """Counts trials of one experiment; a trial passes when its body raises nothing."""

    def __init__(self) -> None:
        self.count = self.passed = 0
        self.failures: list[str] = []

    @contextmanager
    def trial(self, label: str) -> Iterator[None]:
        self.count += 1
        try:
            yield
        except Exception as exc:  # a failed check: recorded, the campaign goes on
            text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
            self.failures.append(f"{label}: {text[:300]}")
        else:
            self.passed += 1

    def row(self, area: str, what: str, outcome: str, count: int | None = None) -> Row:
        return Row(
            area,
            what,
            self.count if count is None else count,
            f"{outcome}: {self.passed}/{self.count}",
            self.passed,
            self.failures[:5],
        )


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
