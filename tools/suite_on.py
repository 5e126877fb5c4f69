"""Run the test suite on another Python and torch: a venv of its own, torch pinned, graphcap installed editable.

    python tools/suite_on.py --python /root/.pyenv/versions/3.12.1/bin/python --torch 2.11.0 \\
        --venv /work/venvs/py312-t211                       # the GPU machine's stack, on the CPU
    python tools/suite_on.py ... -- tests/backends -x      # pytest arguments after --

Makes the venv with `--python` where it does not exist, installs `torch==VERSION` there (a CUDA
build from PyPI is several GB: once per venv, never in CI) with the test dependencies, then this
checkout with `pip install --no-deps -e .`, and runs `python -m pytest -q -n WORKERS -p
no:cacheprovider` in it (the whole suite unless pytest arguments are given). It prints the stack
(Python, torch) and pytest's result line last; the exit status is pytest's. `--dry-run` prints the
commands instead.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_DEPENDENCIES = ("numpy", "tqdm", "pyyaml", "pytest", "pytest-xdist", "hypothesis", "ruff", "matplotlib")
STACK = "import platform, torch; print(f'python {platform.python_version()}, torch {torch.__version__}')"


def commands(args: argparse.Namespace) -> list[list[str]]:
    """What the run does, in order (the venv's creation and installs only where it lacks them)."""
    venv = Path(args.venv)
    python = str(venv / "bin" / "python")
    steps = []
    if not (venv / "bin" / "python").exists():
        steps.append([args.python, "-m", "venv", str(venv)])
        steps.append([python, "-m", "pip", "install", "-q", f"torch=={args.torch}", *TEST_DEPENDENCIES])
    steps.append([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO)])
    steps.append([python, "-c", STACK])
    steps.append([python, "-m", "pytest", "-q", "-n", str(args.workers), "-p", "no:cacheprovider", *args.pytest])
    return steps


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not Path(args.python).exists() and not (Path(args.venv) / "bin" / "python").exists():
        print(
            f"suite_on: --python {args.python} does not exist; give the interpreter to make the venv with "
            "(e.g. /root/.pyenv/versions/3.12.1/bin/python)",
            file=sys.stderr,
        )
        return 2
    steps = commands(args)
    if args.dry_run:
        for step in steps:
            print(shlex.join(step))
        return 0
    for step in steps[:-1]:
        subprocess.run(step, check=True, cwd=REPO)
    return subprocess.run(steps[-1], cwd=REPO).returncode


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the interpreter the venv is made with")
    parser.add_argument("--torch", required=True, help="the torch version to pin, e.g. 2.11.0")
    parser.add_argument("--venv", required=True, help="the venv's folder (made where missing, reused otherwise)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("pytest", nargs="*", help="pytest arguments (after --); default: the whole suite")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
