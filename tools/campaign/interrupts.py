"""Ctrl-C at each stage of a running `graphcap verify`, sent when the process says it got there.

`graphcap -v` logs a DEBUG line `stage: NAME` as each step of a command begins (the config,
the torch import, the model, the capture pass, ...). `interrupt_at` reads the child's stderr
until the stage's line and only then sends SIGINT, so the signal never lands before graphcap's
handler exists (a SIGINT during interpreter start-up is Python's, not graphcap's) and no test
waits on a clock. The child must then end by SIGINT with one "interrupted" line.

Shared by `tests/cli/test_startup.py` and `tools/reliability.py`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from .cli_setups import TINY

__all__ = ["STAGES", "interrupt_at", "interrupted_cleanly"]

STAGES = (
    "verify started",
    "importing torch",
    "building the model",
    "capturing",
    "staging every key",
    "replaying random steps",
)
"""The stages of `graphcap verify`, in order, as its `stage:` log lines name them."""


def interrupt_at(stage: str, workdir: Path, *, limit: float = 300.0) -> tuple[int, str]:
    """Run `python -m graphcap verify -v` (long enough to outlast every stage), send SIGINT once its
    stderr names `stage`; (return code, stderr). `limit` seconds is only a safety net: a child
    that never reaches the stage or never ends is killed, and the result then says so."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(TINY, sort_keys=False))
    argv = ["verify", "--config", str(workdir / "tiny.yaml"), "--batches", "100000", "--no-progress", "-v"]
    process = subprocess.Popen(
        [sys.executable, "-m", "graphcap", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(limit, process.kill)
    watchdog.start()
    try:
        lines = []
        for line in process.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if line.rstrip().endswith(f"stage: {stage}"):
                process.send_signal(signal.SIGINT)
                break
        else:
            process.wait()
            said = "".join(lines[-5:])
            raise AssertionError(f"the command ended (exit {process.returncode}) before stage {stage!r}: {said!r}")
        rest = process.stderr.read()  # type: ignore[union-attr]
        process.wait()
        return process.returncode, "".join(lines) + rest
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()  # type: ignore[union-attr]


def interrupted_cleanly(code: int, err: str) -> bool:
    """What `interrupt_at` must see: death by SIGINT, one "interrupted" line last, no traceback."""
    lines = [line for line in err.splitlines() if not line.startswith(("DEBUG ", "INFO "))]
    return (
        code == -signal.SIGINT
        and "Traceback" not in err
        and "Exception ignored" not in err
        and lines == ["graphcap verify: interrupted"]
    )
