"""The command's start-up and exit: no torch for `--help`/`--version`/`validate`, Ctrl-C at any
moment is one line and exit 130, a stdout that cannot be written is one line and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import graphcap.backends
from graphcap.cli import _main, main
from tests.tools import TOOLS

sys.path.insert(0, str(TOOLS))  # tools/campaign/: Ctrl-C at each stage, shared with the campaign

from campaign.interrupts import STAGES, interrupt_at, interrupted_cleanly

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "graphcap" / "configs" / "tiny-cpu-ci.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _loaded_after(argv: list[str]) -> list[str]:
    probe = (
        "import sys\nfrom graphcap.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=ENV, timeout=60)
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["capture", "--help"], ["bench", "--help"], ["validate", TINY]],
    ids=["help", "version", "capture-help", "bench-help", "validate"],
)
def test_help_version_and_validate_never_import_torch(argv):
    assert _loaded_after(argv) == "[]"


def test_help_loads_only_the_command_line_and_torch_free_leaves():
    # `graphcap --help` within 2x a bare interpreter: the config package, numpy and the errors
    # load when a command runs, not to print the help (tools/bench_startup.py measures it).
    probe = (
        "import sys\nfrom graphcap.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('graphcap')), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=60)
    loaded = set(eval(result.stderr.strip().splitlines()[-1]))
    others = {m for m in loaded if not m.startswith("graphcap.cli.")} - {"graphcap.cli", "graphcap"}
    assert others <= {"graphcap.devices", "graphcap.sizing", "graphcap.sizing.sizes"}, others
    assert "graphcap.cli._setup" not in loaded  # what builds a manager loads with the command that needs it


def test_version_is_the_installed_metadata_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"graphcap {version('graphcap')}\n"


def test_backend_choices_are_the_backends_names():
    parser = _main.build_parser()
    capture = parser._subparsers._group_actions[0].choices["capture"]
    (backend,) = [a for a in capture._actions if "--backend" in a.option_strings]
    assert tuple(backend.choices) == graphcap.backends.BACKEND_NAMES


def test_subcommands_are_listed_in_pipeline_order():
    names = [m.__name__.rsplit(".", 1)[1] for m in _main.COMMANDS]
    assert names == ["capture", "verify", "sizes", "bench", "validate", "inspect"]


@pytest.mark.parametrize("stage", STAGES)
def test_ctrl_c_at_every_stage_is_one_line_and_ends_by_sigint(tmp_path, stage):
    # The signal goes out when the process logs the stage (never after a sleep): from the moment
    # graphcap's handler exists, through the torch import, the model, the capture pass, the sweep.
    code, err = interrupt_at(stage, tmp_path)
    assert interrupted_cleanly(code, err), (code, err)  # a shell reports 130


def test_verify_logs_every_stage_in_order(capsys):
    # The interrupt tests wait on these lines: each must exist, in this order.
    argv = ["verify", "--config", TINY, "--batches", "1", "--steps", "2", "--no-progress", "-v"]
    assert main(argv) == 0
    said = [line.partition("stage: ")[2] for line in capsys.readouterr().err.splitlines() if "stage: " in line]
    assert said == list(STAGES)


def test_main_returns_130_when_interrupted(capsys, monkeypatch):
    from graphcap.cli import sizes

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sizes, "run", interrupted)
    assert main(["sizes"]) == 130
    assert capsys.readouterr().err == "graphcap sizes: interrupted\n"


_SWALLOWING = """
import contextlib, signal, sys
from graphcap.cli import main, sizes

def swallowing(args):
    with contextlib.suppress(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    if sys.argv[1] == "fails":
        raise AttributeError("module 'numpy' has no attribute 'matrix'")
    return 0

sizes.run = swallowing
before = signal.getsignal(signal.SIGINT)
code = main(["sizes"])
print(code, signal.getsignal(signal.SIGINT) is before)
"""


@pytest.mark.parametrize("then", ["fails", "succeeds"])
def test_an_interrupt_that_library_code_swallows_still_ends_as_interrupted(then):
    # What happened under load: Ctrl-C cut an import short inside torch, the KeyboardInterrupt
    # was swallowed, and the broken module surfaced later as an AttributeError. The SIGINT is real, so it
    # is raised in a child process: in the test process it could land inside any Python code that runs next
    # (a gc callback of hypothesis, printing a KeyboardInterrupt traceback in a green run).
    result = subprocess.run(
        [sys.executable, "-c", _SWALLOWING, then], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.stdout == "130 True\n", result.stdout + result.stderr  # the handler is put back
    assert result.stderr == "graphcap sizes: interrupted\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_stdout_on_a_full_disk_is_one_line_and_exit_1():
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "graphcap", "sizes"], stdout=full, stderr=subprocess.PIPE, text=True, env=ENV
        )
    assert result.returncode == 1
    assert result.stderr == ("graphcap sizes: failed: cannot write the output to stdout: No space left on device\n")


def test_a_reader_that_goes_away_is_not_an_error():
    # `graphcap sizes | head -1`: the pipe closes early; no BrokenPipeError noise, exit 0.
    process = subprocess.Popen(
        [sys.executable, "-m", "graphcap", "sizes", "--max-size", "4096"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    process.stdout.readline()
    process.stdout.close()
    err = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=60) == 0
    assert err == ""


def test_a_command_without_torch_installed_is_one_line_and_exit_2(tmp_path):
    # `None` in sys.modules is how Python spells "not installed" for an import: ModuleNotFoundError.
    probe = "import sys\nsys.modules['torch'] = None\nfrom graphcap.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", probe, "capture", "--config", TINY], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr == (
        "graphcap capture: error: torch is not installed: install the torch build for this machine first "
        "(README, Quick start), then graphcap\n"
    )
    assert (
        subprocess.run(  # validate needs no torch
            [sys.executable, "-c", probe, "validate", TINY], capture_output=True, text=True, env=ENV, timeout=120
        ).returncode
        == 0
    )
