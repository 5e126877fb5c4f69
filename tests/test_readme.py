"""README.md stays true: its test command is `.ci/run`'s, its example runs, its schema is complete."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import torch

from graphcap.backends import UNSAFE_OPS
from graphcap.config import CaptureConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_second():
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick_start, flags=re.S)
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and commands[0].endswith("graphcap capture")
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci_lines == [commands[1]]


def test_library_example_runs():
    example = _blocks("python")[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["logits"].shape[0] == 3
    assert namespace["manager"].dispatch(namespace["batch"]).num_tokens == 4


def test_piecewise_example_runs_and_replays_pieces():
    example = next(block for block in _blocks("python") if "eager_op" in block)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    manager, batch = namespace["manager"], namespace["batch"]
    assert manager.stats.piecewise_replays == 1 and manager.stats.eager_op_calls == 1
    replayed = namespace["logits"].clone()
    assert replayed.shape == (4, 128)
    torch.testing.assert_close(replayed, manager.eager(batch))


def test_every_config_key_is_documented():
    config = CaptureConfig()
    for top in fields(config):
        if not top.init:  # derived on construction (capture_sizes), not a key
            continue
        value = getattr(config, top.name)
        names = (
            [top.name]
            if not hasattr(value, "__dataclass_fields__")
            else [f"{top.name}.{f.name}" for f in fields(value) if f.init]
        )
        for name in names:
            assert f"`{name}`" in README, f"README's YAML table misses {name}"


def test_every_unsafe_op_family_is_documented():
    for op in ("item", "nonzero", "masked_select", "unique", "repeat_interleave", "bincount", ".cpu()", ".numpy()"):
        assert op in README, op
    assert len(UNSAFE_OPS) >= 20


def test_capture_safe_example_names_the_host_copy_and_its_line(capsys):
    example = next(block for block in _blocks("python") if "check_capture_safe" in block)
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out == "Tensor.cpu at README.md:8\n"
