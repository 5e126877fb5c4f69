"""The files, factories, faults and checks that the hostile-command cases (`cli_cases.py`) use.

A setup writes a case's files under its own directory; a check reads the outcome
`(tmp, stdout, stderr)` and raises `AssertionError` when it is wrong; a skip names why this
machine cannot run a case. The factories are what the cases point `model.factory` at.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

TINY = {
    "device": "cpu",
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 128},
    "batching": {"max_num_seqs": 4, "max_num_tokens": 16},
    "kv_cache": {"block_size": 4, "num_blocks": 40, "max_model_len": 32},
    "capture": {"sizes": [2, 4], "num_warmups": 1},
}
"""The one-layer config every case runs (`{tiny}` in a case's argv)."""
# An 8B-shaped model with a cache no machine holds: refused on any realistic host.
HUGE = {
    "model": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "vocab_size": 128256},
    "model_extra": {"intermediate_size": 14336, "dtype": "bfloat16"},
    "kv_cache": {"block_size": 16, "num_blocks": 131072, "max_model_len": 2048},
    "batching": {"max_num_seqs": 256, "max_num_tokens": 2048},
    "capture": {"max_size": 512},
}


# -- factories the cases point model.factory at -------------------------------------------


def raising_factory(config: Any) -> Any:
    raise ValueError("checkpoint /models/llama/consolidated.00.pth is missing")


def _tiny_llama(config: Any) -> Any:
    from dataclasses import replace

    from graphcap.models import build_model

    return build_model(replace(config, model=replace(config.model, factory=None, name="tiny-llama")))


def unsafe_factory(config: Any) -> Any:
    """A model whose forward reads a device value on the host: no key can be captured."""
    model = _tiny_llama(config)
    forward = model.forward

    def read_a_value(inputs: Any) -> Any:
        out = forward(inputs)
        return out * float(out[0, 0] > 0)  # .item() in disguise: capture-unsafe

    model.forward = read_a_value
    return model


def estimated_factory(config: Any) -> Any:
    return _tiny_llama(config)


estimated_factory.estimate_memory = lambda config: {"checkpoint": 3 << 20}  # type: ignore[attr-defined]


# -- setups and checks ------------------------------------------------------------------------


def write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


def symlink_loop(tmp: Path) -> None:
    for a, b in (("a.yaml", "b.yaml"), ("b.yaml", "a.yaml")):
        with contextlib.suppress(FileExistsError):
            (tmp / a).symlink_to(tmp / b)


def chmod_zero(tmp: Path) -> None:
    (tmp / "secret.yaml").write_text("device: cpu\n")
    (tmp / "secret.yaml").chmod(0)


def self_report(tmp: Path) -> None:
    doc = {**TINY, "report": {"path": str(tmp / "self.yaml")}}
    (tmp / "self.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def outside_report(tmp: Path) -> None:
    (tmp / "proj").mkdir(exist_ok=True)
    doc = {**TINY, "report": {"path": "/proc/graphcap-escape.json"}}
    (tmp / "proj" / "escape.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def ci_workflow(tmp: Path) -> None:
    workflow = tmp / ".github" / "workflows" / "ci.yml"
    workflow.parent.mkdir(parents=True, exist_ok=True)
    workflow.write_text(_CI_YML)
    doc = {**TINY, "report": {"path": str(workflow)}}
    (tmp / "overwrite.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


_CI_YML = "on: push\njobs:\n  test:\n    runs-on: ubuntu-latest\n"


def ci_unchanged(tmp: Path, out: str, err: str) -> None:
    if (tmp / ".github" / "workflows" / "ci.yml").read_text() != _CI_YML:
        raise AssertionError("the workflow was overwritten")


def factory_beside_config(tmp: Path) -> None:
    (tmp / "proj").mkdir(exist_ok=True)
    (tmp / "proj" / "beside_config_factory.py").write_text(
        "def make(config):\n    raise ValueError('found beside the config')\n"
    )
    doc = {**TINY, "model": {**TINY["model"], "factory": "beside_config_factory:make"}}
    (tmp / "proj" / "factory.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def huge_buffer(tmp: Path) -> None:
    """An engine buffer of 2**40 float64 values per token: no machine holds it."""
    buffer = {"name": "huge", "rows": "tokens", "shape": [1 << 20, 1 << 20], "dtype": "float64"}
    (tmp / "hugebuf.yaml").write_text(yaml.safe_dump({**TINY, "buffers": [buffer]}, sort_keys=False))


def unchanged(name: str) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        if yaml.safe_load((tmp / name).read_text()).get("model") != TINY["model"]:
            raise AssertionError(f"{name} was overwritten")

    return check


def report_mode(expected: int | None) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        umask = os.umask(0)
        os.umask(umask)
        want = (0o666 & ~umask) if expected is None else expected
        mode = (tmp / "report.json").stat().st_mode & 0o777
        if mode != want:
            raise AssertionError(f"report mode {mode:o}, expected {want:o}")

    return check


def report_contents(tmp: Path, out: str, err: str) -> None:
    data = json.loads((tmp / "report.json").read_text())
    env = data["environment"]
    for key in ("graphcap", "python", "torch", "cuda_runtime", "device_name"):
        if key not in env:
            raise AssertionError(f"environment lacks {key}")
    if not data["command"].startswith("graphcap capture --config") or not data["created"].endswith("+00:00"):
        raise AssertionError(f"command {data['command']!r} or timestamp {data['created']!r}")
    if not re.fullmatch(r"[0-9a-f]{16}", data["config_fingerprint"]):
        raise AssertionError(f"fingerprint {data['config_fingerprint']!r}")
    if "upper bound" not in data["memory_meaning"]["pool_bytes"]:
        raise AssertionError("the emulated memory total is not labelled")


def table_printed(tmp: Path, out: str, err: str) -> None:
    if "graphs captured:" not in out:
        raise AssertionError("the capture table was lost")


def first_log_line_has_estimate(tmp: Path, out: str, err: str) -> None:
    first = err.splitlines()[0]
    if "memory estimate" not in first or "weights" not in first:
        raise AssertionError(f"first log line: {first!r}")


def out_has(text: str) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        if text not in out + err:
            raise AssertionError(f"{text!r} not in the output")

    return check


def magic(name: str, magic: bytes) -> Callable[[Path, str, str], None]:
    def check(tmp: Path, out: str, err: str) -> None:
        data = (tmp / name).read_bytes()
        if not data.startswith(magic):
            raise AssertionError(f"{name} starts with {data[:8]!r}, not {magic!r}")
        if [p.name for p in tmp.iterdir() if p.name.startswith(f".{name}")]:
            raise AssertionError("a temporary file was left")

    return check


@contextlib.contextmanager
def disk_full() -> Iterator[None]:
    real = os.fsync

    def fail(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = fail
    try:
        yield
    finally:
        os.fsync = real


def root() -> str | None:
    return "root reads any file" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def missing(path: str) -> Callable[[], str | None]:
    return lambda: None if os.path.exists(path) else f"no {path} here"


def with_cuda() -> str | None:
    import torch

    return "CUDA is available here" if torch.cuda.is_available() else None


def overcommit_always() -> str | None:
    try:
        with open("/proc/sys/vm/overcommit_memory") as handle:
            always = handle.read().strip() == "1"
    except OSError:
        return "cannot tell whether a 4 TiB allocation fails at once here"
    return "the kernel overcommits every allocation" if always else None


def huge_fits() -> str | None:
    from graphcap.config import load_config
    from graphcap.memory.estimate import available_memory, estimate_memory

    config = load_config(overrides={**_huge_overrides(), "device": "cpu"})
    available, _ = available_memory("cpu")
    too_big = available is not None and estimate_memory(config).total > available
    return None if too_big else "this machine could hold the huge config"


def _huge_overrides() -> dict[str, Any]:
    flat = {f"model.{k}": v for k, v in {**HUGE["model"], **HUGE["model_extra"]}.items()}
    for section in ("kv_cache", "batching", "capture"):
        flat.update({f"{section}.{k}": v for k, v in HUGE[section].items()})
    return flat


def huge_yaml(tmp: Path) -> None:
    doc: dict[str, Any] = {"device": "cpu"}
    for dotted, value in _huge_overrides().items():
        section, _, key = dotted.partition(".")
        doc.setdefault(section, {})[key] = value
    (tmp / "huge.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
