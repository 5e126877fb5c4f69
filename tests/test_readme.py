"""The README and the guide stay true: every Python block runs, every transcript is the real
output of its command, the test command is `.ci/run`'s, every config key and unsafe op is
documented, and every page and link exists."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from graphcap.backends import UNSAFE_OPS
from graphcap.cli import main
from graphcap.config import CaptureConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "GUIDE.md"
PAGES = sorted((ROOT / "docs" / "guide").glob("*.md"))
LINKED = {
    (GUIDE.parent / page).resolve()
    for row in GUIDE.read_text().splitlines()
    if row.startswith("| [")
    for page in re.findall(r"\]\(([\w./-]+\.md)\)", row)
}
"""Every page the guide's table links (its own pages, and docs/ pages beside them): the guide says their blocks run."""
DOCS = [README, GUIDE, *sorted({*PAGES, *LINKED} - {README, GUIDE})]


def _text(doc: Path) -> str:
    return doc.read_text()


def _blocks(doc: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _text(doc), flags=re.S)


def _name(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


# -- the README is what a user needs first ----------------------------------------------------


def test_the_readme_holds_what_a_user_needs_first_in_order():
    titles = re.findall(r"^## (.+)$", _text(README), flags=re.M)
    assert titles == [
        "Quick start", "Use it as a library", "The command line", "Modes", "The checks", "When a step crashes",
        "Graphs in a running engine", "Tensor and data parallel", "More", "Layout",
    ]  # fmt: skip
    assert len(_text(README).splitlines()) <= 330, "the rest belongs in docs/guide/"


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_second():
    quick_start = _text(README).split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick_start, flags=re.S)
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and commands[0].endswith("graphcap capture")
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci_lines == [commands[1]]


def test_the_guide_lists_every_page_and_every_link_resolves():
    listed = set(re.findall(r"\]\((guide/[\w-]+\.md)\)", _text(GUIDE)))
    assert listed == {f"guide/{page.name}" for page in PAGES}
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", _text(doc)):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{_name(doc)} links to {target}, which does not exist"


# -- every Python block runs ------------------------------------------------------------------


def _library_example(namespace: dict, out: str) -> None:
    assert namespace["logits"].shape[0] == 3
    assert namespace["manager"].dispatch(namespace["batch"]).num_tokens == 4


def _piecewise_example(namespace: dict, out: str) -> None:
    manager, batch = namespace["manager"], namespace["batch"]
    assert manager.stats.piecewise_replays == 1 and manager.stats.eager_op_calls == 1
    replayed = namespace["logits"].clone()
    assert replayed.shape == (4, 128)
    torch.testing.assert_close(replayed, manager.eager(batch))


def _capture_safe_example(namespace: dict, out: str) -> None:
    assert out == "Tensor.cpu at backends.md:8\n"  # the op and the user's own line


def _block_table_example(namespace: dict, out: str) -> None:
    table = namespace["table"]
    assert table.row(0).tolist() == [2, 3, 4] and table.top == 1
    assert namespace["logits"].shape[0] == 1


def _lazy_example(namespace: dict, out: str) -> None:
    manager = namespace["manager"]
    assert manager.stats.eager["pending"] == 1 and sum(manager.stats.graph_hits.values()) == 1
    assert manager.last_key.num_tokens == 4 and manager.registry.pending() == []


def _sampling_example(namespace: dict, out: str) -> None:
    manager = namespace["manager"]
    assert manager._sampler.checked == 1 and sum(manager.stats.graph_hits.values()) == 2
    torch.testing.assert_close(namespace["logits"].clone(), manager.eager(namespace["batch"]))


def _first_model_example(namespace: dict, out: str) -> None:
    report, manager, batch = namespace["report"], namespace["manager"], namespace["batch"]
    assert report.records and all(r.verified for r in report.records)
    assert [r.key.num_tokens for r in report.records if r.full_batch_only] == [1, 1]
    assert manager.dispatch(batch).num_tokens == 4 and namespace["logits"].shape == (3, 512)


def _cumulative_example(namespace: dict, out: str) -> None:
    report = namespace["report"]
    assert report.records and all(r.verified for r in report.records)
    assert namespace["key"].num_reqs == 4 and namespace["staged"] == [0, 1, 4, 6, 6]
    assert out.startswith("paged_kv_indptr[4] is 0, expected 6: each padded entry repeats the last real entry")


def _size_choice_example(namespace: dict, out: str) -> None:
    choice = namespace["choice"]
    assert set(choice.sizes) <= {1, 2, 37, 60} and choice.sizes[-1] == 60 and choice.waste == 0.0


def _axis_choice_example(namespace: dict, out: str) -> None:
    chosen = namespace["chosen"]
    assert chosen.sizes == (1, 8) and chosen.num_graphs == 10
    assert [(row.value, row.slot_waste) for row in chosen.values()][3] == (4, 0.25)  # lora=3 replays lora=4
    assert list(chosen.eager_reasons()) == ["above_max_axis.lora"]  # lora=9: above the largest value, 8


def _output_rows_example(namespace: dict, out: str) -> None:
    assert namespace["MyModel"].output_rows == {"hidden": "tokens", "logits": "reqs"}


def _block_zero_example(namespace: dict, out: str) -> None:
    manager, batch = namespace["manager"], namespace["batch"]
    assert batch.block_table.tolist() == [[1, 8, 0, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0]]
    assert manager.config.kv_cache.num_blocks == 32 and namespace["logits"].shape == (2, 512)
    assert out.startswith("block_table refused: block_table[0, 0] is 0") and "null block 0" in out


def _kernels_per_key_example(namespace: dict, out: str) -> None:
    manager, report, model = namespace["manager"], namespace["report"], namespace["model"]
    assert all(r.verified for r in report.records)
    assert [r.pieces for r in report.records if r.key.num_reqs is None] == [2, 2]  # sizes 8 and 4
    assert manager.stats.as_dict()["graph_hits"] == {"uniform(tokens=4, reqs=4)": 2, "piecewise(tokens=8)": 1}
    assert out == "[] False 1\n" and model.phases == []  # a decode replay runs no Python; outside a step


CHECKS = {
    '"checks.sample_every": 2': _sampling_example,
    "class FirstModel(": _first_model_example,
    "def plan(seq_lens, block_size": _cumulative_example,
    "def graphcap_table(engine_rows": _block_zero_example,
    "def attention_in_graph(q, k, v)": _kernels_per_key_example,
    "choose_sizes(counts, 30": _size_choice_example,
    "choose_with_axes(steps, 20": _axis_choice_example,
    'output_rows = {"hidden": "tokens"': _output_rows_example,
    "manager.capture_pending(max_seconds=0.05)": _lazy_example,
    "manager.dispatch(batch), manager.stats": _library_example,
    "@graphcap.eager_op": _piecewise_example,
    "check_capture_safe(": _capture_safe_example,
    "table.move(1, 0)": _block_table_example,
}
"""What each Python block must leave behind beyond running, by a line only it has."""

PYTHON_BLOCKS = [(doc, block) for doc in DOCS for block in _blocks(doc, "python")]


def test_every_python_block_is_checked_and_every_check_has_its_block():
    for doc, block in PYTHON_BLOCKS:
        assert sum(marker in block for marker in CHECKS) == 1, f"a Python block of {_name(doc)} has no check"
    assert sorted(CHECKS) == sorted(m for m in CHECKS for _, block in PYTHON_BLOCKS if m in block)


@pytest.mark.parametrize(
    ("doc", "block"), PYTHON_BLOCKS, ids=[f"{_name(d)}:{i}" for i, (d, _) in enumerate(PYTHON_BLOCKS)]
)
def test_every_python_block_runs(doc, block, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(block, doc.name, "exec"), namespace)
    (check,) = [check for marker, check in CHECKS.items() if marker in block]
    check(namespace, capsys.readouterr().out)


# -- every transcript is the real output ------------------------------------------------------


def _transcripts() -> list[tuple[Path, str, str]]:
    """(doc, command, expected output) for every `$ command` line of every ```text block."""
    found = []
    for doc in DOCS:
        for block in _blocks(doc, "text"):
            if not block.startswith("$ "):
                continue  # an example, not a transcript
            for chunk in re.split(r"^(?=\$ )", block, flags=re.M):
                if chunk:
                    command, _, output = chunk.partition("\n")
                    found.append((doc, command[2:], output))
    return found


TRANSCRIPTS = _transcripts()

_VOLATILE = (
    (re.compile(r"\b\d+\.\d+ s\b"), "<seconds>"),  # wall times
    (re.compile(r"^((?:uniform|mixed|piecewise)\s+\d+\s+\S+)\s+\d+\.\d+", re.M), r"\1 <ms>"),  # capture ms
    (re.compile(r"does not fit in the [\d.]+ \w+ [^;]*;"), "does not fit in the <this machine's memory>;"),
)
"""What differs from run to run and machine to machine; everything else must match exactly."""


def _normalized(text: str) -> str:
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _run(command: str) -> str:
    argv = shlex.split(command)
    if argv[0] == "graphcap":  # in-process, stdout and stderr interleaved as a terminal shows them
        both = io.StringIO()
        with contextlib.redirect_stdout(both), contextlib.redirect_stderr(both):
            main(argv[1:])
        return both.getvalue()
    assert argv[0] == "python", f"a transcript runs graphcap or python, not {argv[0]}"
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    return done.stdout


def _fits_this_machine(command: str) -> bool:
    """Whether a transcript of a refusal for memory would not be refused here."""
    from graphcap.config import load_config
    from graphcap.memory.estimate import available_memory, estimate_memory

    argv = shlex.split(command)
    config = load_config(argv[argv.index("--config") + 1], {"device": argv[argv.index("--device") + 1]})
    available, _ = available_memory("cpu")
    return available is None or estimate_memory(config).total <= available


def test_every_transcript_is_found():
    commands = [" ".join(command.split()[:2]) for _, command, _ in TRANSCRIPTS]
    for expected in ("graphcap capture", "graphcap validate", "graphcap verify", "graphcap sizes"):
        assert expected in commands
    assert any(c.startswith("python tools/mini_engine.py") for c in commands)


@pytest.mark.parametrize(
    ("doc", "command", "expected"), TRANSCRIPTS, ids=[f"{_name(d)}: {c}" for d, c, _ in TRANSCRIPTS]
)
def test_every_transcript_is_the_real_output(doc, command, expected, monkeypatch):
    monkeypatch.chdir(ROOT)
    if "does not fit in the" in expected and _fits_this_machine(command):
        pytest.skip("this machine could hold the config the transcript is refused for")
    assert _normalized(_run(command)) == _normalized(expected)


# -- every config key and unsafe op is documented ---------------------------------------------


def test_every_config_key_is_documented():
    text = _text(ROOT / "docs" / "guide" / "configs.md")
    config = CaptureConfig()
    for top in fields(config):
        if not top.init or not top.metadata.get("key", True):  # derived, or not a key (source)
            continue
        value = getattr(config, top.name)
        names = (
            [top.name]
            if not hasattr(value, "__dataclass_fields__")
            else [f"{top.name}.{f.name}" for f in fields(value) if f.init]
        )
        for name in names:
            assert f"`{name}`" in text, f"docs/guide/configs.md's key table misses {name}"


def test_every_unsafe_op_family_is_documented():
    text = _text(ROOT / "docs" / "guide" / "backends.md")
    for op in ("item", "nonzero", "masked_select", "unique", "repeat_interleave", "bincount", ".cpu()", ".numpy()"):
        assert op in text, op
    assert len(UNSAFE_OPS) >= 20


def test_the_engines_guide_documents_every_key_of_stats_as_dict():
    from graphcap.keys import StepStats

    text = _text(ROOT / "docs" / "guide" / "engines.md").split("**What `manager.stats.as_dict()` holds**", 1)[1]
    table = text.split("\n\n", 2)[1]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert documented == list(StepStats().as_dict()), "docs/guide/engines.md's stats table and as_dict() differ"
