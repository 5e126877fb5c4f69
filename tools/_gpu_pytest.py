"""gpu_check's P10: pytest over the CUDA test files, each test under its own timeout.

Also a pytest plugin (`-p _gpu_pytest --per-test-timeout=S --watchdog-file=PATH`): each test runs
with `faulthandler.dump_traceback_later(S, exit=True)` armed, a watchdog thread that writes every
thread's stack to PATH (pytest's capture would swallow stderr) and ends the process past S
seconds, even inside a CUDA call that never returns (where a Python signal handler would never
run). `cuda_tests` reads pytest's verbose lines, names the test that was running as timed out (or
crashed), and starts pytest again without the tests already done, until every test ran or the
phase's seconds are spent. Imports no torch.
"""

from __future__ import annotations

import faulthandler
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS_SECONDS = 105  # inside the phase's budget: a slow run still reports which tests ran
PER_TEST_SECONDS = 20.0  # the slowest GPU test (the 8B-shaped engine reservation) takes a few seconds
CUDA_TEST_FILES = ("tests/backends/test_cuda.py", "tests/backends/test_cuda_engine.py")
WATCHDOG = "Timeout ("  # how faulthandler's dump begins
WATCHDOG_ENV = "GPU_CHECK_WATCHDOG"  # the watchdog file's path, for the tests under it
_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_STARTED = re.compile(r"^(\S+::\S+) *$")


_watchdog: dict = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--per-test-timeout", type=float, default=None, help="seconds each test may take")
    parser.addoption("--watchdog-file", default=None, help="where a timed-out test's stacks are written")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("watchdog_file")
    if path:
        _watchdog["file"] = open(path, "a")  # noqa: SIM115  (open until the process ends)
        os.environ[WATCHDOG_ENV] = path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    seconds = item.config.getoption("per_test_timeout")
    if seconds:
        faulthandler.dump_traceback_later(seconds, exit=True, file=_watchdog.get("file", sys.stderr))
    try:
        yield
    finally:
        if seconds:
            faulthandler.cancel_dump_traceback_later()


def read_verbose(stdout: str) -> tuple[dict[str, str], str | None]:
    """pytest -v's output: (outcome by test id, the test that started and never ended, or None)."""
    outcomes: dict[str, str] = {}
    running = None
    for line in stdout.splitlines():
        ended = _OUTCOME.match(line)
        if ended:
            outcomes[ended.group(1)] = ended.group(2)
            running = None
        else:
            started = _STARTED.match(line)
            if started:
                running = started.group(1)
    return outcomes, running if running not in outcomes else None


def round_command(files: Sequence[str], per_test: float, done: Sequence[str], watchdog: Path) -> list[str]:
    """The pytest command of one round: the plugin armed, every test already done deselected."""
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "_gpu_pytest"]
    command += [f"--per-test-timeout={per_test:g}", f"--watchdog-file={watchdog}", *files]
    return command + [f"--deselect={test}" for test in done]


def run_tests(files: Sequence[str], seconds: float, per_test: float, cwd: Path = ROOT) -> dict:
    """Every test of `files` once, each within `per_test`, all within `seconds`.

    A round that ends inside a test (the watchdog's timeout, or a crash) records that test and
    starts the next round without every test done so far.
    """
    ends = time.monotonic() + seconds
    outcomes: dict[str, str] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    finished, rounds, stacks = False, 0, {}
    while ends - time.monotonic() > 5:
        rounds += 1
        watchdog = Path(tempfile.mkdtemp()) / "watchdog.txt"
        command = round_command(files, per_test, list(outcomes), watchdog)
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, cwd=cwd, timeout=ends - time.monotonic(), env=env
            )
        except subprocess.TimeoutExpired as exc:  # the phase's seconds ran out: keep what ran
            seen = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            outcomes.update(read_verbose(seen)[0])
            break
        seen, running = read_verbose(done.stdout)
        outcomes.update(seen)
        if running is None:
            finished = True
            break
        dumped = watchdog.read_text() if watchdog.exists() else ""
        timed_out = WATCHDOG in dumped
        outcomes[running] = f"TIMEOUT after {per_test:g} s" if timed_out else f"CRASHED (exit {done.returncode})"
        stacks[running] = dumped[:1500] if timed_out else done.stderr[-1500:]  # the innermost frames first
    return {"outcomes": outcomes, "finished": finished, "rounds": rounds, "stacks": stacks}


def cuda_tests(device: str, quick: bool) -> dict:
    run = run_tests(CUDA_TEST_FILES, CUDA_TESTS_SECONDS, PER_TEST_SECONDS)
    return summarise(run, CUDA_TESTS_SECONDS)


def summarise(run: dict, seconds: float) -> dict:
    outcomes = run["outcomes"]
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        word = outcome.split()[0].lower().replace("timeout", "timed out")
        counts[word] = counts.get(word, 0) + 1
    bad = ("FAILED", "ERROR", "TIMEOUT", "CRASHED")
    failed = [test for test, outcome in outcomes.items() if outcome.split()[0] in bad]
    summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no tests ran"
    if not run["finished"]:
        summary += f"; stopped after {seconds:g} s with tests left"
    observed = summary + (f" ({'; '.join(failed)})" if failed else "")
    return {"ok": run["finished"] and not failed and bool(outcomes), "observed": observed, "failed": failed, **run}


CASES = {"cuda_tests": cuda_tests}
