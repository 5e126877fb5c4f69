"""`CaptureConfig`: the root of the config tree, and the rules that span its sections.

Each section checks itself (`sections.py`, `checks.py`, `model.py`, `buffers.py`); the root checks what
spans sections (`capture.max_size <= batching.max_num_tokens`, ...) and builds the capture
schedule once. `load_config` (in `_load.py`) collects the problems of all sections into one
`ConfigError` and adds `file:line` from the YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

import graphcap.config.checks as check_sections
import graphcap.config.sections as sections
from graphcap.config._schema import Section, problem
from graphcap.config.buffers import BufferConfig
from graphcap.config.model import ModelConfig
from graphcap.devices import device_problem
from graphcap.errors import ConfigProblem
from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes

__all__ = ["SECTIONS", "CaptureConfig"]

SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "batching": sections.BatchingConfig,
    "kv_cache": sections.KVCacheConfig,
    "capture": sections.CaptureSectionConfig,
    "checks": check_sections.ChecksConfig,
    "report": check_sections.ReportConfig,
    "padding": sections.PadRules,
}
"""The sections of a config file, by key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureConfig(Section):
    """The whole configuration. Build it with `load_config`, or directly from sections.

    `capture_sizes` (the validated schedule, `auto` expanded) is built once, here.
    """

    _key: ClassVar[str] = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to capture."""
    device: str = "auto"
    """`auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:N`."""
    batching: sections.BatchingConfig = field(default_factory=sections.BatchingConfig)
    """Scheduler limits."""
    kv_cache: sections.KVCacheConfig = field(default_factory=sections.KVCacheConfig)
    """The paged KV cache."""
    capture: sections.CaptureSectionConfig = field(default_factory=sections.CaptureSectionConfig)
    """What to capture."""
    checks: check_sections.ChecksConfig = field(default_factory=check_sections.ChecksConfig)
    """Safety checks."""
    report: check_sections.ReportConfig = field(default_factory=check_sections.ReportConfig)
    """Capture report output."""
    padding: sections.PadRules = field(default_factory=sections.PadRules)
    """Pad rules of the persistent buffers."""
    buffers: tuple[BufferConfig, ...] = ()
    """The engine's own persistent buffers (the `buffers:` list), staged like the built-ins."""
    source: str | None = field(default=None, compare=False, repr=False, metadata={"key": False})
    """The file `load_config` read (None: a config shipped with graphcap, text, or built in
    code); not a config key. A factory module is also looked up beside it (`graphcap.models.load_factory`)."""
    capture_sizes: CaptureSizes = field(init=False, repr=False, compare=False, default=None)  # type: ignore[assignment]
    """The validated schedule (`capture.sizes`, with `auto` expanded), built on construction."""

    def _check(self) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        bad_device = device_problem(self.device)
        if bad_device:
            out.append(problem("device", bad_device))
        cap, bat, kv, pad = self.capture, self.batching, self.kv_cache, self.padding
        on_cuda = self.device.startswith("cuda") and not bad_device
        if on_cuda and cap.num_warmups == 0 and cap.mode != "none":
            out.append(
                problem(
                    "capture.num_warmups",
                    f"0 with device {self.device}: the cuda backend needs at least 1 eager run before each capture "
                    "(lazy cuBLAS, Triton and torch.compile initialisation must happen outside the graph); set 1",
                )
            )
        if cap.max_size is not None and cap.max_size > bat.max_num_tokens:  # None: resolved by the section
            out.append(
                problem(
                    "capture.max_size" if cap.sizes == "auto" else "capture.sizes",
                    f"{cap.max_size} exceeds batching.max_num_tokens {bat.max_num_tokens}; the persistent buffers "
                    "cannot hold it: lower capture.max_size or raise batching.max_num_tokens",
                    involves=("batching",),
                )
            )
        if kv.max_model_len < cap.uniform_query_len:
            out.append(
                problem(
                    "kv_cache.max_model_len",
                    f"{kv.max_model_len} is shorter than capture.uniform_query_len {cap.uniform_query_len}",
                    involves=("capture",),
                )
            )
        for name, limit, message, section in (
            ("token_id", self.model.vocab_size, "is not a valid token id (model.vocab_size {})", "model"),
            ("block_id", kv.num_blocks, "is not a valid block (kv_cache.num_blocks {})", "kv_cache"),
            ("position", kv.max_model_len, "is not below kv_cache.max_model_len {}", "kv_cache"),
        ):  # a padded row's value must index what it indexes
            value = getattr(pad, name)
            if value >= limit:
                out.append(problem(f"padding.{name}", f"{value} {message.format(limit)}", involves=(section,)))
        if pad.seq_len > kv.max_model_len:
            out.append(
                problem(
                    "padding.seq_len",
                    f"{pad.seq_len} is above kv_cache.max_model_len {kv.max_model_len}; a padded request "
                    "attends to at most max_model_len keys (use 0, or 1 for SGLang-style kernels)",
                    involves=("kv_cache",),
                )
            )
        seen: dict[str, int] = {}
        for i, buffer in enumerate(self.buffers):
            if buffer.name in seen:
                out.append(
                    problem(
                        f"buffers[{i}].name", f"{buffer.name!r} is declared twice (also buffers[{seen[buffer.name]}])"
                    )
                )
            seen.setdefault(buffer.name, i)
        for i, group in enumerate(kv.groups):  # padded rows of every group's table hold the pad block too
            if group.num_blocks is not None and pad.block_id >= group.num_blocks:  # None: refused by the group
                where = f"kv_cache.groups[{i}].num_blocks {group.num_blocks}"
                out.append(
                    problem(
                        "padding.block_id", f"{pad.block_id} is not a valid block ({where})", involves=("kv_cache",)
                    )
                )
        if out:
            return out
        sizes = _schedule(cap, bat.max_num_tokens)
        object.__setattr__(self, "capture_sizes", sizes)
        if cap.mode == "none":
            return out
        q = cap.uniform_query_len
        reach = bat.max_num_seqs * kv.max_model_len
        if cap.mode in ("full", "piecewise", "full_and_piecewise") and sizes.max_size > reach:
            # The mixed (or piecewise) key of that size could not even be filled by its dummy batch.
            out.append(
                problem(
                    "capture.max_size" if cap.sizes == "auto" else "capture.sizes",
                    f"size {sizes.max_size} can never be reached: a step holds at most batching.max_num_seqs "
                    f"{bat.max_num_seqs} requests of kv_cache.max_model_len {kv.max_model_len} tokens = {reach}; "
                    f"lower capture.max_size to {reach} or drop the larger sizes",
                    involves=("batching", "kv_cache"),
                )
            )
        if cap.mode == "full_decode_only" and not any(s % q == 0 and s // q <= bat.max_num_seqs for s in sizes):
            out.append(
                problem(
                    "capture.mode",
                    f"full_decode_only captures uniform keys only, but no size in {list(sizes)} is a multiple of "
                    f"uniform_query_len {q} with at most batching.max_num_seqs {bat.max_num_seqs} requests",
                    involves=("batching",),
                )
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready); `load_config` of it gives an equal config."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if not f.init or not f.metadata.get("key", True):
                continue
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value = _section_dict(value)
            elif f.name == "buffers":
                value = [_section_dict(buffer) for buffer in value]
            out[f.name] = value
        return out


def _schedule(cap: sections.CaptureSectionConfig, max_num_tokens: int) -> CaptureSizes:
    if cap.sizes != "auto":
        return CaptureSizes(cap.sizes, max_num_tokens)
    max_size = sections.DEFAULT_MAX_SIZE if cap.max_size is None else cap.max_size  # resolved by the section already
    return CaptureSizes(default_capture_sizes(max_size, cap.uniform_query_len), max_num_tokens)


def _section_dict(section: Section) -> dict[str, Any]:
    return {f.name: _plain(getattr(section, f.name)) for f in fields(section) if f.init}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_section_dict(v) if isinstance(v, Section) else _plain(v) for v in value]
    if isinstance(value, MappingProxyType):  # tuples inside (capture.axes) as lists: YAML-ready
        return {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
    return value
