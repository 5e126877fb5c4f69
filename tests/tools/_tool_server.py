"""The process `tests.tools.run_tool` forks tools from: torch and graphcap imported once, nothing run.

Started by `tests.tools.ToolServer` with a line protocol on its stdin and stdout: each request is a
JSON line (`path`, `args`, `cwd`, `env`, `stdout`, `stderr`: the script, its arguments, its working
folder, its whole environment and two files for its output); the server forks, answers
`{"pid": N}` at once and `{"code": N}` when the child has ended (`subprocess`'s return code: the
exit status, or minus the signal that ended it). The child runs the script as `python SCRIPT ARGS`
would (`__main__`, `sys.argv`, the script's folder first on `sys.path`, its own environment and
folder), writes what it prints to the two files, and ends with the script's exit status (1 and the
traceback for an exception). What the child inherits is an interpreter that has imported torch,
numpy and graphcap and run no torch op (no thread pool to break across the fork).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import traceback

import numpy  # noqa: F401  # preloaded for every tool
import torch
import torch.distributed

import graphcap
import graphcap.manager  # noqa: F401


def _child(request: dict, protocol: tuple[int, int]) -> None:
    code = 1
    try:
        for fd in protocol:
            os.close(fd)
        for target, name in ((1, "stdout"), (2, "stderr")):
            fd = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:  # read by torch at its import, which is done
            torch.set_num_threads(int(threads))
        sys.argv = [request["path"], *request["args"]]
        sys.path.insert(0, os.path.dirname(request["path"]))
        code = 0
        try:
            runpy.run_path(request["path"], run_name="__main__")
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:  # wait for non-daemon threads, as the interpreter's exit does
            shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    read_fd, write_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    requests = os.fdopen(read_fd, "r")
    answers = os.fdopen(write_fd, "w")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, (read_fd, write_fd))
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
