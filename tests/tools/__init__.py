"""Tests of the scripts under `tools/` (no timing asserts: timings belong in docs/BENCHMARKS.md).

`run_tool` runs a tool as `python tools/NAME ARGS` would, in a process of its own, and returns a
`subprocess.CompletedProcess`. The process is a fork of `_tool_server.py`, which each test process
starts once and which has imported torch and graphcap (about 2 s of CPU that every tool run would
otherwise pay again); `GRAPHCAP_TEST_SUBPROCESS=1`, or a platform without `fork`, starts a fresh
interpreter instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"


def run_tool(name: str, *args: str, cwd: Path = REPO, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run `tools/NAME` with this interpreter; the checkout is importable even without `pip install -e .`."""
    path = os.environ.get("PYTHONPATH")
    environ = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""), **env}
    if os.environ.get("GRAPHCAP_TEST_SUBPROCESS") == "1" or not hasattr(os, "fork"):
        return subprocess.run(
            [sys.executable, str(TOOLS / name), *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=environ,
            timeout=timeout,
        )
    return ToolServer.shared().run(TOOLS / name, args, cwd=cwd, env=environ, timeout=timeout)


class ToolServer:
    """A running `_tool_server.py` and the requests this process sends it (one at a time)."""

    _shared: ToolServer | None = None

    def __init__(self) -> None:
        environ = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_tool_server.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=environ,
        )
        self.pending = b""  # what the server wrote past the last answer read
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> ToolServer:
        """This process's server, started on first use (and again if it has died)."""
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
        return cls._shared

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def run(
        self, path: Path, args: tuple[str, ...], *, cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        """`python PATH ARGS` in `cwd` with `env`, forked from the server; `subprocess.run`'s result and timeout."""
        command = [sys.executable, str(path), *args]
        with tempfile.TemporaryDirectory(prefix="graphcap-tool-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"path": str(path), "args": list(args), "cwd": str(cwd), "env": env}
            self.proc.stdin.write(json.dumps({**request, "stdout": str(out), "stderr": str(err)}).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self._answer(None)["pid"]
            deadline = time.monotonic() + timeout
            answer = self._answer(deadline)
            if answer is None:
                with contextlib.suppress(ProcessLookupError):  # it ended as the deadline passed
                    os.kill(pid, signal.SIGKILL)
                self._answer(None)
                raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err))
            return subprocess.CompletedProcess(command, answer["code"], _read(out), _read(err))

    def _answer(self, deadline: float | None) -> dict | None:
        """The server's next line, or None when `deadline` (monotonic) passes first.

        Read from the pipe's descriptor, never through a buffered reader: a buffer could hold the
        next answer already while `select` waits on the descriptor for it.
        """
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if deadline is not None:
                ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the tool server exited (code {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
