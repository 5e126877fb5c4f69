"""`run_tool` forks tools from a preloaded server: what a tool sees and returns is what `python TOOL` gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import REPO, ToolServer

SCRIPT = """
import json, os, sys
if sys.argv[1] == "report":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("TOOL_SERVER_TEST"),
                      "name": __name__, "first_path": sys.path[0]}))
    print("to stderr", file=sys.stderr)
elif sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
elif sys.argv[1] == "message":
    sys.exit("one line of refusal")
elif sys.argv[1] == "raise":
    raise ValueError("deep inside")
elif sys.argv[1] == "hang":
    import signal
    signal.pause()
"""


def run(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "tool.py"
    script.write_text(SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "TOOL_SERVER_TEST": "given", "PYTHONPATH": str(REPO)}
    return ToolServer.shared().run(script, args, cwd=tmp_path, env=env, timeout=timeout)


def test_a_forked_tool_sees_its_arguments_folder_environment_and_main(tmp_path):
    import json

    result = run(tmp_path, "report", "--flag")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"argv": ["report", "--flag"], "cwd": str(tmp_path), "env": "given", "name": "__main__",
                    "first_path": str(tmp_path)}  # fmt: skip
    assert result.stderr == "to stderr\n"
    assert result.args == [sys.executable, str(tmp_path / "tool.py"), "report", "--flag"]


def test_exit_codes_messages_and_tracebacks_are_those_of_a_fresh_interpreter(tmp_path):
    assert run(tmp_path, "exit", "3").returncode == 3
    refused = run(tmp_path, "message")
    assert (refused.returncode, refused.stderr) == (1, "one line of refusal\n")
    raised = run(tmp_path, "raise")
    assert raised.returncode == 1
    assert "Traceback (most recent call last)" in raised.stderr and "ValueError: deep inside" in raised.stderr


def test_a_tool_past_its_timeout_is_killed_and_the_server_serves_the_next(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run(tmp_path, "hang", timeout=0.5)
    assert run(tmp_path, "exit", "0").returncode == 0
