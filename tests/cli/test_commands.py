"""`graphcap capture`, `verify` and `bench`, in-process and as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from graphcap.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "graphcap" / "configs" / "tiny-cpu-ci.yaml")


def run_cli(capsys, *argv):
    code = main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_capture_prints_table_and_summary_and_writes_report(capsys, tmp_path):
    report = tmp_path / "out" / "capture.json"
    code, out, err = run_cli(capsys, "capture", "--config", TINY, "--report", str(report), "--no-progress")
    assert code == 0, err
    assert out.splitlines()[0].split() == ["key", "tokens", "reqs", "capture", "ms", "memory", "verified", "note"]
    assert "graphs captured: 8 of 8 keys (emulated backend on cpu)" in out
    assert "emulated backend" in err and "Traceback" not in err
    data = json.loads(report.read_text())
    assert data["num_graphs"] == 8 and all(g["verified"] for g in data["graphs"])
    assert [g["key"]["num_tokens"] for g in data["graphs"]] == [8, 8, 4, 4, 2, 2, 1, 1]


def test_capture_default_config_as_a_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "graphcap", "capture", "--device", "cpu", "--set", "capture.max_size=4"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "graphs captured: 6 of 6 keys" in result.stdout
    assert "emulated backend reproduces CUDA-graph semantics" in result.stderr


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["capture", "--config", "/nonexistent.yaml"], 2, "config file not found: /nonexistent.yaml"),
        (["capture", "--set", "capture.max_size"], 2, "expected KEY=VALUE"),
        (["capture", "--set", "capture.max_szie=8"], 2, "did you mean max_size"),
        (["capture", "--device", "cuda:7", "--set", "capture.max_size=2"], 2, "device: 'cuda:7'"),
        (["capture", "--device", "tpu"], 2, "device: must be auto, cpu, cuda or cuda:N"),
        (["capture", "--set", "model.name=null", "--set", "model.factory=no_such_pkg.mod:make"], 2, "model.factory"),
        (["verify", "--config", TINY, "--batches", "-1"], 2, "--batches must be >= 0"),
        (["bench", "--config", TINY, "--steps", "0"], 2, "--steps must be >= 1"),
    ],
)
def test_user_errors_exit_2_with_a_message_and_no_traceback(capsys, argv, code, message):
    got, out, err = run_cli(capsys, *argv)
    assert got == code
    assert message in err
    assert "Traceback" not in err and "Traceback" not in out


def test_capture_failure_exits_1_naming_the_key(capsys, tmp_path):
    factory = tmp_path / "broken_model.py"
    factory.write_text(
        "from dataclasses import replace\n"
        "import torch\n"
        "from graphcap.models import build_model\n"
        "class Broken(torch.nn.Module):\n"
        "    def __init__(self, inner):\n"
        "        super().__init__()\n"
        "        self.inner = inner\n"
        "    def forward(self, inputs):\n"
        "        return self.inner.forward(inputs)[inputs.input_ids.nonzero()]\n"
        "def make(config):\n"
        "    model = replace(config.model, factory=None, name='tiny-llama')\n"
        "    return Broken(build_model(replace(config, model=model)))\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        code, out, err = run_cli(
            capsys, "capture", "--config", TINY, "--set", "model.name=null", "--set", "model.factory=broken_model:make"
        )
    finally:
        sys.path.remove(str(tmp_path))
    assert code == 1
    assert "capturing uniform(tokens=8, reqs=8) failed" in err and "aten.nonzero" in err
    assert "Traceback" not in err


def test_verify_passes_on_the_tiny_config(capsys):
    code, out, err = run_cli(capsys, "verify", "--config", TINY, "--batches", "3", "--steps", "6", "--seed", "1")
    assert code == 0, out + err
    assert "staging sweep:" in out and "verify: ok" in out
    # 8 keys; uniform keys hold 1, 2, 4, 8 requests and mixed the same: sum(R + 1) combinations
    assert "staging sweep: 38 (key, real requests)" in out


def test_verify_exits_1_and_names_the_key_on_a_replay_mismatch(capsys, monkeypatch):
    from graphcap.manager import CaptureManager

    real_execute = CaptureManager.execute

    def corrupting_execute(self, batch):
        out = real_execute(self, batch)
        if self.dispatch(batch) is not None and len(out):
            out = out.clone()
            out[0, 0] += 1.0  # what silent corruption of a padded tail looks like downstream
        return out

    monkeypatch.setattr(CaptureManager, "execute", corrupting_execute)
    code, out, err = run_cli(capsys, "verify", "--config", TINY, "--batches", "2", "--steps", "3")
    assert code == 1
    assert "MISMATCH sequence 0, key" in out and "verify: FAILED" in out


def test_bench_prints_medians_and_spread_per_key(capsys):
    code, out, err = run_cli(capsys, "bench", "--config", TINY, "--steps", "3", "--no-progress")
    assert code == 0, err
    lines = out.splitlines()
    header = lines[0].split()
    expected = "key tokens reqs capture ms memory eager ms p10-p90 replay ms p10-p90 speedup"
    assert header == expected.split()
    rows = [line.split() for line in lines[1:] if line.startswith(("uniform", "mixed"))]
    assert len(rows) == 7  # 8 keys; mixed(1, 1) is never dispatched to
    for row in rows:
        eager, (p10, p90) = float(row[6]), map(float, row[7].split("-"))
        assert p10 <= eager <= p90
        assert row[10].endswith("x") and row[-1] in ("!", row[10])
    assert "not timed (no real batch dispatches to them): mixed(tokens=1, reqs=1)" in out


def test_bench_flags_noisy_keys(capsys, monkeypatch):
    from graphcap.capture import timing

    calls = iter(range(10**6))

    class JitteryTimer:  # every third sample 5x slower: an interquartile range far above 10%
        def __init__(self, *args, **kwargs):
            pass

        def timeit(self, number):
            return types.SimpleNamespace(raw_times=[(0.005 if next(calls) % 3 == 0 else 0.001) * number])

    monkeypatch.setattr("torch.utils.benchmark.Timer", JitteryTimer)
    code, out, err = run_cli(
        capsys, "bench", "--config", TINY, "--steps", "6", "--set", "capture.sizes=[2]", "--set", "capture.max_size=2"
    )
    assert code == 0, err
    assert any(line.startswith("uniform") and line.endswith(" !") for line in out.splitlines())
    assert "! noisy (" in out and "interquartile range above 10% of the median" in out
    assert timing.NOISY_IQR == 0.1


@pytest.mark.parametrize("suffix", [".png", ".svg"])  # .pdf: tools/campaign/cli_cases.py
def test_bench_plot_is_written_in_the_format_its_suffix_names(capsys, tmp_path, suffix):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "out" / f"bench{suffix}"
    code, out, err = run_cli(capsys, "bench", "--config", TINY, "--steps", "1", "--plot", str(plot))
    assert code == 0, err
    magic = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF", ".svg": b"<?xml"}[suffix]
    assert plot.read_bytes().startswith(magic)
    assert f"plot written to {plot}" in out
    assert sorted(p.name for p in plot.parent.iterdir()) == [plot.name]  # no temporary file left


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("plots", "is a directory; give a file name such as"),
        ("bench.txt", "unknown image format 'txt'; use one of"),
        ("bench", "no suffix to name the image format"),
        ("file.json/bench.png", "cannot be created: .*file.json is not a directory"),
    ],
)
def test_bench_plot_path_is_checked_before_capturing(capsys, tmp_path, target, message):
    pytest.importorskip("matplotlib")
    (tmp_path / "plots").mkdir()
    (tmp_path / "file.json").write_text("{}")
    code, out, err = run_cli(capsys, "bench", "--config", TINY, "--plot", str(tmp_path / target))
    assert code == 2 and out == ""
    assert re.search(message, err) and err.count("\n") == 1
    assert "emulated backend" not in err  # refused before the model was built


def test_bench_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out, err = run_cli(capsys, "bench", "--config", TINY, "--plot", "x.png")
    assert code == 2
    assert "--plot needs matplotlib: pip install 'graphcap[plot]'" in err


def test_bench_report_carries_the_latency_of_each_timed_key(capsys, tmp_path):
    path = tmp_path / "bench.json"
    code, out, err = run_cli(capsys, "bench", "--config", TINY, "--steps", "2", "--report", str(path))
    assert code == 0, err
    graphs = {(g["key"]["num_tokens"], g["key"]["uniform"]): g for g in json.loads(path.read_text())["graphs"]}
    assert graphs[(1, False)]["latency"] is None  # never dispatched to: not measured
    latency = graphs[(8, True)]["latency"]
    assert set(latency) == {"eager_ms", "replay_ms", "noisy"}
    assert latency["replay_ms"]["samples"] == 2
    assert latency["replay_ms"]["p10"] <= latency["replay_ms"]["median"] <= latency["replay_ms"]["p90"]


def test_help_of_every_command_has_an_example(capsys):
    for command in ("capture", "verify", "sizes", "bench", "validate"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert "example" in capsys.readouterr().out


def test_bench_compares_eager_piecewise_and_full_per_size(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    flags = ("--set", "capture.mode=full_and_piecewise", "--set", "model.attention=per_request")
    code, out, err = run_cli(capsys, "bench", "--config", TINY, *flags, "--steps", "1", "--plot", str(plot))
    assert code == 0, err
    rows = {(line.split()[0], int(line.split()[1])) for line in out.splitlines() if line.startswith(("uniform", "pie"))}
    assert {("uniform", 8), ("piecewise", 8), ("uniform", 2), ("piecewise", 2)} <= rows
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_a_piecewise_mode_without_eager_ops_in_the_built_in_model_is_refused_before_building(capsys):
    code, out, err = run_cli(capsys, "capture", "--config", TINY, "--set", "capture.mode=PIECEWISE")
    assert code == 2 and "Traceback" not in err
    assert "capture.mode piecewise cuts the forward at its eager_op calls" in err
    assert "set model.attention=per_request, or capture.mode=full" in err


def test_bench_pins_torch_threads_while_it_captures_and_times_and_puts_them_back(capsys, monkeypatch):
    import torch

    from graphcap.capture import timing

    seen = []
    real = timing.time_key

    def recording(manager, key, steps=20, warmup=3):
        seen.append(torch.get_num_threads())
        return real(manager, key, steps=steps, warmup=0)

    monkeypatch.setattr(timing, "time_key", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small = ("--set", "capture.sizes=[1,2]", "--set", "capture.max_size=2", "--steps", "1", "--no-progress")
        assert run_cli(capsys, "bench", "--config", TINY, *small)[0] == 0
        assert seen and set(seen) == {1}  # the default: one thread
        seen.clear()
        assert run_cli(capsys, "bench", "--config", TINY, *small, "--threads", "2")[0] == 0
        assert set(seen) == {2}
        assert torch.get_num_threads() == 2  # the caller's setting is back
    finally:
        torch.set_num_threads(before)
    code, out, err = run_cli(capsys, "bench", "--config", TINY, "--threads", "0")
    assert code == 2 and "--threads must be >= 1; got 0" in err


@pytest.mark.parametrize("flag", [(), ("--no-progress",)], ids=["progress", "no-progress"])
def test_bench_shows_progress_while_it_times_unless_told_not_to(capsys, monkeypatch, flag):
    import sys as system

    monkeypatch.setattr(system.stderr, "isatty", lambda: True, raising=False)  # a terminal, as a user has
    small = ("--set", "capture.sizes=[2]", "--set", "capture.max_size=2", "--steps", "1")
    code, out, err = run_cli(capsys, "bench", "--config", TINY, *small, *flag)
    assert code == 0, err
    assert ("timing: " in err) == (not flag), err[-500:]


@pytest.mark.parametrize("flag", [(), ("--no-progress",)], ids=["progress", "no-progress"])
def test_verify_shows_a_bar_over_its_step_sequences_unless_told_not_to(capsys, monkeypatch, flag):
    import sys as system

    monkeypatch.setattr(system.stderr, "isatty", lambda: True, raising=False)  # a terminal, as a user has
    small = ("--set", "capture.sizes=[2]", "--set", "capture.max_size=2", "--batches", "2", "--steps", "2")
    code, out, err = run_cli(capsys, "verify", "--config", TINY, *small, *flag)
    assert code == 0, out + err
    assert ("sequences:   0%|" in err and "| 0/2 [" in err) == (not flag), err[-500:]  # the bar, its total
    assert "sequences" not in out  # results on stdout, progress on stderr


def test_verify_help_says_how_long_it_takes():
    from graphcap.cli.verify import EPILOG

    assert "the embedded default takes 2-6 minutes on a 2-core CPU" in EPILOG and "--no-progress" in EPILOG
