"""Reading a traffic histogram file for `graphcap sizes`: `TOKENS [COUNT]` lines, every problem one line."""

from __future__ import annotations

import math

from graphcap.cli._common import UserError

__all__ = ["MAX_HISTOGRAM_BYTES", "read_histogram"]

MAX_HISTOGRAM_BYTES = 64 << 20
"""Largest histogram read (64 MiB: ten million one-per-line observations)."""
_MAX_LINE = 4096


def read_histogram(path: str) -> dict[int, float]:
    """`TOKENS [COUNT]` lines -> {tokens: weight}; every problem is a `UserError` naming file and line."""
    counts: dict[int, float] = {}
    try:
        with open(path, "rb") as handle:
            read = 0
            for number, raw in enumerate(iter(lambda: handle.readline(_MAX_LINE + 1), b""), 1):
                read += len(raw)
                if len(raw) > _MAX_LINE:
                    raise UserError(f"{path}:{number}: line longer than {_MAX_LINE} bytes; is it a histogram?")
                if read > MAX_HISTOGRAM_BYTES:
                    raise UserError(
                        f"{path}: larger than {MAX_HISTOGRAM_BYTES >> 20} MiB; aggregate it as TOKENS COUNT"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                        "expected TOKENS or TOKENS COUNT"
                    ) from None
                _add_line(counts, line, path, number)
    except OSError as exc:
        raise UserError(f"--histogram {path}: cannot read: {exc.strerror or exc}") from None
    total = sum(counts.values())
    if not counts or total <= 0:
        raise UserError(f"{path}: no batch sizes in the histogram")
    if not math.isfinite(total):
        raise UserError(f"{path}: the counts sum to {total}; scale them down (they are relative weights)")
    return counts


def _add_line(counts: dict[int, float], line: str, path: str, number: int) -> None:
    text = line.split("#", 1)[0].replace(",", " ").split()
    if not text:
        return
    try:
        values = [float(v) for v in text]
    except ValueError:
        raise UserError(f"{path}:{number}: expected TOKENS or TOKENS COUNT; got {line.strip()!r}") from None
    if (
        len(values) > 2
        or not all(map(math.isfinite, values))  # int(inf) and int(nan) raise
        or values[0] != int(values[0])
        or values[0] < 1
        or (len(values) == 2 and values[1] < 0)
    ):
        raise UserError(
            f"{path}:{number}: expected a token count >= 1 and an optional count >= 0; got {line.strip()!r}"
        )
    counts[int(values[0])] = counts.get(int(values[0]), 0.0) + (values[1] if len(values) == 2 else 1.0)
