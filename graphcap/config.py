"""`CaptureConfig`: a frozen dataclass tree, validated on construction, loaded from strict YAML.

Every section checks its own fields in `__post_init__` (types, ranges, choices) and the
root checks what spans sections (`capture.max_size <= batching.max_num_tokens`, ...).
Each check raises `ConfigError` listing every problem with its dotted key; `load_config`
collects the problems of all sections into one error and adds `file:line` from the YAML.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

from graphcap._schema import INT32_MAX, INT32_MIN, ConfigError, ConfigProblem, Section, show_value, spec
from graphcap._yaml import YamlSyntaxError, read_yaml
from graphcap.sizes import CaptureSizes, default_capture_sizes

__all__ = [
    "BUILTIN_MODELS",
    "PAD_SLOT_ID",
    "BatchingConfig",
    "CaptureConfig",
    "CaptureOptions",
    "ChecksConfig",
    "ConfigError",
    "ConfigProblem",
    "KVCacheConfig",
    "ModelConfig",
    "PadRules",
    "ReportConfig",
    "load_config",
    "resolve_device",
]

PAD_SLOT_ID = -1
"""`slot_mapping` value of a token that must not write the KV cache."""


BUILTIN_MODELS = ("tiny-llama",)
"""Names accepted by `model.name` (built by `graphcap.models.build_model`)."""

DEFAULT_CONFIG = "default.yaml"
"""The embedded default, shipped inside the package (`graphcap/configs/`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(Section):
    """The model to capture: a built-in reference model or an importable factory."""

    _key: ClassVar[str] = "model"
    name: str | None = None
    """Built-in model (`tiny-llama`); the default when `factory` is not set either."""
    factory: str | None = None
    """`"pkg.module:function"`, called with the `CaptureConfig`; returns the model."""
    hidden_size: int = spec(256, min=1)
    """Width of the residual stream."""
    num_layers: int = spec(2, min=1)
    """Decoder layers."""
    num_heads: int = spec(8, min=1)
    """Query heads; `hidden_size` must divide evenly among them."""
    num_kv_heads: int = spec(2, min=1)
    """Key/value heads (grouped-query attention); must divide `num_heads`."""
    intermediate_size: int | None = spec(None, min=1)
    """SwiGLU width; null means 8/3 of hidden_size rounded up to a multiple of 64."""
    vocab_size: int = spec(4096, min=1, max=INT32_MAX)
    """Token ids are valid in `[0, vocab_size)`."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weight and activation dtype."""
    seed: int = spec(0, min=0)
    """Seed of the deterministic random weights."""
    rope_theta: float = spec(10000.0, gt=0)
    """Rotary embedding base."""
    rms_norm_eps: float = spec(1e-5, gt=0)
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        Section.__post_init__(self)
        if self.name is None and self.factory is None:
            object.__setattr__(self, "name", BUILTIN_MODELS[0])

    def _check(self) -> list[tuple[str, str]]:
        out = []
        if self.name is not None and self.factory is not None:
            out.append(
                (
                    "factory",
                    f"give model.name or model.factory, not both; got name {self.name!r} and factory {self.factory!r}",
                )
            )
        if self.name is not None and self.name not in BUILTIN_MODELS:
            out.append(
                (
                    "name",
                    f'unknown model {self.name!r}; built in: {", ".join(BUILTIN_MODELS)} (or use model.factory: "pkg.module:function")',
                )
            )
        if self.factory is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.factory):
            out.append(("factory", f'must look like "pkg.module:function"; got {self.factory!r}'))
        if self.hidden_size % self.num_heads:
            out.append(("num_heads", f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"))
        elif (self.hidden_size // self.num_heads) % 2:
            out.append(
                (
                    "num_heads",
                    f"head size {self.hidden_size // self.num_heads} (hidden_size / num_heads) must be even for rotary embeddings",
                )
            )
        if self.num_heads % self.num_kv_heads:
            out.append(
                ("num_kv_heads", f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
            )
        return out

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """`intermediate_size`, or its default: 8/3 of hidden_size rounded up to 64."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchingConfig(Section):
    """Scheduler limits; the persistent buffers are allocated once at these maxima."""

    _key: ClassVar[str] = "batching"
    max_num_seqs: int = spec(32, min=1, max=INT32_MAX)
    """Most requests in one step."""
    max_num_tokens: int = spec(256, min=1, max=INT32_MAX)
    """Most tokens in one step (all requests together)."""

    def _check(self) -> list[tuple[str, str]]:
        if self.max_num_seqs > self.max_num_tokens:
            return [
                (
                    "max_num_seqs",
                    f"{self.max_num_seqs} exceeds batching.max_num_tokens {self.max_num_tokens}; every request has at least one token, so lower max_num_seqs to {self.max_num_tokens}",
                )
            ]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheConfig(Section):
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots each.

    Block 0 is the null block: padded rows point at it and dummy runs write into it, so
    an engine must never hand block 0 to a live request.
    """

    _key: ClassVar[str] = "kv_cache"
    block_size: int = spec(16, min=1, max=INT32_MAX)
    """Token slots per block."""
    num_blocks: int = spec(256, min=2, max=INT32_MAX)
    """Blocks in the cache, the null block 0 included."""
    max_model_len: int = spec(512, min=1, max=INT32_MAX)
    """Longest sequence (prompt + generated) one request may reach."""

    def _check(self) -> list[tuple[str, str]]:
        out = []
        usable = (self.num_blocks - 1) * self.block_size
        if self.max_model_len > usable:
            out.append(
                (
                    "max_model_len",
                    f"{self.max_model_len} tokens do not fit the KV cache: {self.num_blocks - 1} usable blocks (block 0 is the null block) x block_size {self.block_size} = {usable}; raise kv_cache.num_blocks to {-(-self.max_model_len // self.block_size) + 1} or lower max_model_len",
                )
            )
        if self.num_slots > INT32_MAX:
            out.append(
                (
                    "num_blocks",
                    f"{self.num_blocks} blocks x block_size {self.block_size} = {self.num_slots} slots exceed the int32 range of slot_mapping ({INT32_MAX}); lower kv_cache.num_blocks to at most {INT32_MAX // self.block_size}",
                )
            )
        return out

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureOptions(Section):
    """Which graphs to capture and how."""

    _key: ClassVar[str] = "capture"
    mode: Literal["none", "full", "full_decode_only"] = "full"
    """`none`: always eager; `full`: mixed and uniform-decode keys; `full_decode_only`: uniform only."""
    sizes: tuple[int, ...] | Literal["auto"] = "auto"
    """Ascending token counts to capture, or `auto` for `default_capture_sizes(max_size, q)`."""
    max_size: int = spec(64, min=1, max=1 << 16)
    """Largest captured token count; bigger steps run eagerly. At most 65536: the padding
    table holds one entry per token count, so a typo like 10**9 must not try to build it."""
    num_warmups: int = spec(1, min=0, max=100)
    """Eager runs of each dummy batch before its capture."""
    uniform_query_len: int = spec(1, min=1, max=64)
    """Tokens per request in a uniform decode step (> 1 for speculative decoding)."""
    on_error: Literal["raise", "skip"] = "raise"
    """A size that fails to capture: `raise` stops; `skip` records it and runs it eagerly."""

    def _check(self) -> list[tuple[str, str]]:
        if self.sizes == "auto":
            try:
                default_capture_sizes(self.max_size, self.uniform_query_len)
            except ValueError as exc:
                return [("max_size", str(exc))]
            return []
        # Bounded first: validating builds a padding table as long as the largest size.
        largest = max(self.sizes, default=0)
        if largest > self.max_size:
            return [
                (
                    "sizes",
                    f"largest size {largest} exceeds capture.max_size {self.max_size}; raise max_size to {largest} or drop the larger sizes",
                )
            ]
        try:
            CaptureSizes(self.sizes, self.max_size)
        except ValueError as exc:
            return [("sizes", f"{exc}; got {list(self.sizes)}" if "got" not in str(exc) else str(exc))]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class ChecksConfig(Section):
    """Safety checks on every step and after capture."""

    _key: ClassVar[str] = "checks"
    invariants: Literal["off", "basic", "full"] = "basic"
    """`basic` (O(requests), every step), `full` (adds O(tokens) checks and address checks on every replay), or `off`."""
    verify_replay: bool = True
    """After each capture, replay once and compare with an eager run on the same inputs."""
    atol: float | None = spec(None, min=0)
    """Absolute tolerance of that comparison; null uses torch.testing's default for the dtype."""
    rtol: float | None = spec(None, min=0)
    """Relative tolerance; give both or neither."""
    poison_padding: bool = False
    """Debug: fill the persistent buffers with sentinel garbage before every staging."""
    sync_debug: bool = False
    """CUDA: run warmups under `torch.cuda.set_sync_debug_mode("error")` to name host syncs."""

    def _check(self) -> list[tuple[str, str]]:
        if (self.atol is None) != (self.rtol is None):
            return [
                (
                    "atol",
                    f"give checks.atol and checks.rtol together or neither; got atol={self.atol}, rtol={self.rtol}",
                )
            ]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportConfig(Section):
    """Where the capture report goes."""

    _key: ClassVar[str] = "report"
    path: str | None = None
    """Write the `CaptureReport` here (`.json`, `.yaml` or `.yml`), atomically; null: don't."""

    def _check(self) -> list[tuple[str, str]]:
        if self.path is not None and Path(self.path).suffix not in (".json", ".yaml", ".yml"):
            return [("path", f"must end in .json, .yaml or .yml; got {self.path!r}")]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class PadRules(Section):
    """How the padded tail of each persistent buffer is filled (rows `[real : padded]`).

    Data, not literals in the staging loop: an engine whose kernels want padded requests of
    length 1 (SGLang's convention) sets `query_len: 1, seq_len: 1`.
    """

    _key: ClassVar[str] = "padding"
    query_len: int = spec(0, min=0, max=INT32_MAX)
    """Tokens given to each padded request (its `query_start_loc` step), while tokens remain."""
    seq_len: int = spec(0, min=0, max=INT32_MAX)
    """`seq_lens` of padded requests; must be >= query_len."""
    slot: int = spec(PAD_SLOT_ID, min=INT32_MIN, max=-1)
    """`slot_mapping` of padded tokens: negative, so they never write the KV cache."""
    position: int = spec(0, min=0, max=INT32_MAX)
    """`positions` of padded tokens."""
    token_id: int = spec(0, min=0, max=INT32_MAX)
    """`input_ids` of padded tokens (a valid token id)."""
    block_id: int = spec(0, min=0, max=INT32_MAX)
    """`block_table` entries of padded requests (the null block)."""

    def _check(self) -> list[tuple[str, str]]:
        if self.seq_len < self.query_len:
            return [
                (
                    "seq_len",
                    f"{self.seq_len} is smaller than padding.query_len {self.query_len}; a padded request must satisfy seq_len >= query_len",
                )
            ]
        return []


_SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "batching": BatchingConfig,
    "kv_cache": KVCacheConfig,
    "capture": CaptureOptions,
    "checks": ChecksConfig,
    "report": ReportConfig,
    "padding": PadRules,
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureConfig(Section):
    """The whole configuration. Build it with `load_config`, or directly from sections."""

    _key: ClassVar[str] = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to capture."""
    device: str = "auto"
    """`auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:N`."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Scheduler limits."""
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    """The paged KV cache."""
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    """What to capture."""
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    """Safety checks."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """Capture report output."""
    padding: PadRules = field(default_factory=PadRules)
    """Pad rules of the persistent buffers."""

    def _check(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if not _DEVICE.fullmatch(self.device):
            out.append(("device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}"))
        cap, bat, kv = self.capture, self.batching, self.kv_cache
        if cap.max_size > bat.max_num_tokens:
            out.append(
                (
                    "capture.max_size",
                    f"{cap.max_size} exceeds batching.max_num_tokens {bat.max_num_tokens}; the persistent buffers cannot hold it: lower capture.max_size or raise batching.max_num_tokens",
                )
            )
        if kv.max_model_len < cap.uniform_query_len:
            out.append(
                (
                    "kv_cache.max_model_len",
                    f"{kv.max_model_len} is shorter than capture.uniform_query_len {cap.uniform_query_len}",
                )
            )
        pad = self.padding
        if pad.token_id >= self.model.vocab_size:
            out.append(
                (
                    "padding.token_id",
                    f"{pad.token_id} is not a valid token id (model.vocab_size {self.model.vocab_size})",
                )
            )
        if pad.block_id >= kv.num_blocks:
            out.append(
                ("padding.block_id", f"{pad.block_id} is not a valid block (kv_cache.num_blocks {kv.num_blocks})")
            )
        if pad.position >= kv.max_model_len:
            out.append(("padding.position", f"{pad.position} is not below kv_cache.max_model_len {kv.max_model_len}"))
        if not out and cap.mode != "none":
            sizes = self.capture_sizes.sizes
            q = cap.uniform_query_len
            reach = bat.max_num_seqs * kv.max_model_len
            if cap.mode == "full" and sizes[-1] > reach:
                # The mixed key of that size could not even be filled by its dummy batch.
                out.append(
                    (
                        "capture.max_size" if cap.sizes == "auto" else "capture.sizes",
                        f"size {sizes[-1]} can never be reached: a step holds at most batching.max_num_seqs {bat.max_num_seqs} requests of kv_cache.max_model_len {kv.max_model_len} tokens = {reach}; lower capture.max_size to {reach} or drop the larger sizes",
                    )
                )
            if cap.mode == "full_decode_only" and not any(s % q == 0 and s // q <= bat.max_num_seqs for s in sizes):
                out.append(
                    (
                        "capture.mode",
                        f"full_decode_only captures uniform keys only, but no size in {list(sizes)} is a multiple of uniform_query_len {q} with at most batching.max_num_seqs {bat.max_num_seqs} requests",
                    )
                )
        return out

    @property
    def capture_sizes(self) -> CaptureSizes:
        """The validated schedule (`capture.sizes`, with `auto` expanded)."""
        cap = self.capture
        sizes = cap.sizes
        if sizes == "auto":
            sizes = default_capture_sizes(cap.max_size, cap.uniform_query_len)
        return CaptureSizes(sizes, self.batching.max_num_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready); `load_config` of it gives an equal config."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value = {g.name: _plain(getattr(value, g.name)) for g in fields(value)}
            out[f.name] = value
        return out


def resolve_device(config: CaptureConfig):
    """The `torch.device` that `config.device` names: `auto` is cuda when available, else cpu.

    Raises `ConfigError` (key `device`) when cuda is requested and unavailable, or when
    `cuda:N` names a GPU that does not exist.
    """
    import torch

    requested = config.device
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        message = f"{requested!r} requested but CUDA is not available (torch {torch.__version__}, {built}); use device: cpu or auto"
        raise ConfigError([ConfigProblem("device", message)])
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        message = f"{requested!r} names GPU {device.index} but {count} visible; use cuda:0 to cuda:{count - 1}, or check CUDA_VISIBLE_DEVICES"
        raise ConfigError([ConfigProblem("device", message)])
    return device


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> CaptureConfig:
    """Load a `CaptureConfig` from YAML; `path=None` is the embedded default.

    `overrides` maps dotted keys to values (`{"capture.max_size": 16}`) applied on top of
    the file and validated the same way. Raises `ConfigError` listing every problem (dotted
    key, bad value, what is allowed, `file:line`), `FileNotFoundError` for a missing file, or
    `TypeError` when `overrides` is not a mapping.
    """
    if path is None:
        text = resources.files("graphcap").joinpath("configs", DEFAULT_CONFIG).read_text()
        source = f"<embedded {DEFAULT_CONFIG}>"
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except (IsADirectoryError, UnicodeDecodeError) as exc:
            raise ConfigError([ConfigProblem("<file>", f"cannot read {path}: {exc}")], source) from None
    return config_from_text(text, source, overrides)


def config_from_text(text: str, source: str = "<string>", overrides: dict[str, Any] | None = None) -> CaptureConfig:
    """`load_config` on YAML text already in memory."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must map dotted keys to values; got {type(overrides).__name__}")
    try:
        doc = read_yaml(text, source)
    except YamlSyntaxError as exc:
        raise ConfigError([ConfigProblem(exc.key or "<yaml>", exc.message, exc.where)], source) from None
    data = {} if doc.data is None else doc.data
    if not isinstance(data, dict):
        raise ConfigError(
            [
                ConfigProblem(
                    "<root>", f"the root must be a mapping of sections; got {type(data).__name__}", f"{source}:1"
                )
            ],
            source,
        )
    problems: list[ConfigProblem] = []
    data, override_keys = _apply_overrides(data, overrides or {}, problems)

    def where(key: str) -> str | None:
        if key in override_keys or key.split("[")[0] in override_keys:
            return "override"
        while key:
            if key in doc.lines:
                return f"{source}:{doc.lines[key]}"
            key = key.rpartition(".")[0] if "." in key else key.partition("[")[0] if "[" in key else ""
        return None

    kwargs: dict[str, Any] = {}
    valid_top = ["device", *_SECTIONS]
    for name, value in data.items():
        if name == "device":
            kwargs["device"] = value
        elif name not in _SECTIONS:
            problems.append(_unknown(name, "", valid_top))
        elif value is None:
            continue  # an empty section means its defaults
        elif not isinstance(value, dict):
            problems.append(ConfigProblem(name, f"must be a mapping of keys; got {show_value(value)}"))
        else:
            cls = _SECTIONS[name]
            valid = [f.name for f in fields(cls)]
            unknown = [k for k in value if k not in valid]
            problems += [_unknown(k, name, valid) for k in unknown]
            try:
                kwargs[name] = cls(**{k: v for k, v in value.items() if k in valid})
            except ConfigError as exc:
                problems += exc.problems
    failed = {p.key.partition(".")[0] for p in problems}
    try:
        config = CaptureConfig(**kwargs)
    except ConfigError as exc:
        # Sections that failed were left at their defaults: keep only the cross-field
        # problems that do not involve one of them, so each problem is real.
        problems += [p for p in exc.problems if not any(p.key.startswith(f) or f"{f}." in p.message for f in failed)]
    if problems:
        located = [p._replace(where=p.where or where(p.key)) for p in problems]
        located.sort(key=lambda p: _line_of(p.where))
        raise ConfigError(located, source)
    return config


def _apply_overrides(data: dict, overrides: dict[str, Any], problems: list[ConfigProblem]):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    applied = set()
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if len(parts) == 1 and parts[0] == "device":
            data["device"] = value
        elif len(parts) == 2 and parts[0] in _SECTIONS:
            section = data.get(parts[0])
            if section is None:
                section = data[parts[0]] = {}
            if not isinstance(section, dict):
                continue  # the section's own problem is reported
            section[parts[1]] = value
        else:
            valid = ["device", *(f"{s}.KEY" for s in _SECTIONS)]
            problems.append(
                ConfigProblem(str(dotted), f"not a config key; overrides look like {', '.join(valid)}", "override")
            )
            continue
        applied.add(str(dotted))
    return data, applied


def _unknown(name: str, section: str, valid: list[str]) -> ConfigProblem:
    key = f"{section}.{name}" if section else name
    hint = difflib.get_close_matches(str(name), valid, n=1)
    did_you_mean = f" (did you mean {hint[0]}?)" if hint else ""
    return ConfigProblem(
        key, f"unknown key{did_you_mean}; valid keys{' in ' + section if section else ''}: {', '.join(valid)}"
    )


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _line_of(where: str | None) -> tuple[int, str]:
    if where and ":" in where:
        tail = where.rpartition(":")[2]
        if tail.isdigit():
            return int(tail), where
    return 1 << 30, where or ""
