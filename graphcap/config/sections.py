"""`CaptureConfig` and its sections: frozen dataclasses, validated on construction.

Every section checks its own fields in `__post_init__` (types, ranges, choices) and then
its cross-field rules in `_check`; the root `CaptureConfig` checks what spans sections
(`capture.max_size <= batching.max_num_tokens`, ...). Each check raises `ConfigError`
listing every problem with its dotted key; `load_config` (in `_load.py`) collects the
problems of all sections into one error and adds `file:line` from the YAML.

Naming: the root is `CaptureConfig` (DESIGN's public name), so the `capture:` section's
class is `CaptureSectionConfig`; the `padding:` section is `PadRules`, the name engines
use for it. Every other section is `<Name>Config`.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from graphcap.config._schema import INT32_MAX, INT32_MIN, ConfigProblem, Section, problem, spec
from graphcap.config.buffers import BufferConfig
from graphcap.devices import BACKEND_NAMES, device_problem
from graphcap.sizes import CaptureSizes, default_capture_sizes

__all__ = [
    "BACKEND_NAMES",
    "BUILTIN_MODELS",
    "PAD_SLOT_ID",
    "BatchingConfig",
    "CaptureConfig",
    "CaptureOptions",
    "CaptureSectionConfig",
    "ChecksConfig",
    "KVCacheConfig",
    "ModelConfig",
    "PadRules",
    "ReportConfig",
    "SECTIONS",
]

PAD_SLOT_ID = -1
"""`slot_mapping` value of a token that must not write the KV cache."""

BUILTIN_MODELS = ("tiny-llama",)
"""Names accepted by `model.name` (built by `graphcap.models.build_model`)."""

DEFAULT_MAX_SIZE = 64
"""`capture.max_size` when neither it nor an explicit `capture.sizes` list is given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(Section):
    """The model to capture: a built-in reference model or an importable factory."""

    _key: ClassVar[str] = "model"
    name: str | None = None
    """Built-in model (`tiny-llama`); the default when `factory` is not set either."""
    factory: str | None = None
    """`"pkg.module:function"`, called with the `CaptureConfig`; returns the model."""
    hidden_size: int = spec(256, min=1, max=1 << 16)
    """Width of the residual stream (at most 65536; the largest published models use 16384-25600)."""
    num_layers: int = spec(2, min=1, max=1 << 10)
    """Decoder layers (at most 1024)."""
    num_heads: int = spec(8, min=1, max=1 << 10)
    """Query heads; `hidden_size` must divide evenly among them (at most 1024)."""
    num_kv_heads: int = spec(2, min=1, max=1 << 10)
    """Key/value heads (grouped-query attention); must divide `num_heads`."""
    intermediate_size: int | None = spec(None, min=1, max=1 << 20)
    """SwiGLU width; null means 8/3 of hidden_size rounded up to a multiple of 64 (at most 1048576)."""
    vocab_size: int = spec(4096, min=1, max=1 << 24)
    """Token ids are valid in `[0, vocab_size)` (at most 16777216; today's largest are ~256k)."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weight and activation dtype."""
    seed: int = spec(0, min=0, max=2**64 - 1)
    """Seed of the deterministic random weights (torch generators take 0 to 2**64 - 1)."""
    rope_theta: float = spec(10000.0, gt=0)
    """Rotary embedding base."""
    rms_norm_eps: float = spec(1e-5, gt=0)
    """RMSNorm epsilon."""
    attention: Literal["vectorized", "per_request"] = "vectorized"
    """Reference model only: `vectorized` paged attention (graph-safe), or `per_request`, a Python
    loop over requests with `.item()` lengths marked `graphcap.eager_op` (graph-unsafe; the
    vectorized path stands in for it inside full graphs): a model for the piecewise modes."""
    options: Mapping = field(default_factory=dict)
    """A factory model's own settings, passed through to it untouched (`config.model.options`):
    any mapping with string keys. graphcap reads none of it."""

    def __post_init__(self) -> None:
        Section.__post_init__(self)
        if self.name is None and self.factory is None:
            object.__setattr__(self, "name", BUILTIN_MODELS[0])
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # read-only, like the rest

    def _check(self) -> list[ConfigProblem]:
        out = []
        if self.name is not None and self.factory is not None:
            out.append(
                problem(
                    "factory",
                    f"give model.name or model.factory, not both; got name {self.name!r} and factory {self.factory!r}",
                )
            )
        if self.name is not None and self.name not in BUILTIN_MODELS:
            out.append(
                problem(
                    "name",
                    f"unknown model {self.name!r}; built in: {', '.join(BUILTIN_MODELS)} "
                    '(or use model.factory: "pkg.module:function")',
                )
            )
        if self.factory is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.factory):
            out.append(problem("factory", f'must look like "pkg.module:function"; got {self.factory!r}'))
        bad_keys = [k for k in self.options if not isinstance(k, str)]
        if bad_keys:
            out.append(problem("options", f"keys must be strings; got {bad_keys[0]!r}"))
        if self.factory is not None:
            return out  # the shape rules below are the built-in model's; a factory model has its own
        if self.hidden_size % self.num_heads:
            out.append(
                problem("num_heads", f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            )
        elif (self.hidden_size // self.num_heads) % 2:
            out.append(
                problem(
                    "num_heads",
                    f"head size {self.hidden_size // self.num_heads} (hidden_size / num_heads) "
                    "must be even for rotary embeddings",
                )
            )
        if self.num_heads % self.num_kv_heads:
            out.append(
                problem(
                    "num_kv_heads", f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
                )
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
    max_num_seqs: int = spec(32, min=1, max=1 << 20)
    """Most requests in one step (at most 1048576; engines run hundreds to a few thousand)."""
    max_num_tokens: int = spec(256, min=1, max=1 << 24)
    """Most tokens in one step, all requests together (at most 16777216)."""

    def _check(self) -> list[ConfigProblem]:
        if self.max_num_seqs > self.max_num_tokens:
            return [
                problem(
                    "max_num_seqs",
                    f"{self.max_num_seqs} exceeds batching.max_num_tokens {self.max_num_tokens}; every request "
                    f"has at least one token, so lower max_num_seqs to {self.max_num_tokens}",
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
    block_size: int = spec(16, min=1, max=1 << 16)
    """Token slots per block (at most 65536)."""
    num_blocks: int = spec(256, min=2, max=INT32_MAX)
    """Blocks in the cache, the null block 0 included."""
    max_model_len: int = spec(512, min=1, max=1 << 24)
    """Longest sequence (prompt + generated) one request may reach (at most 16777216 tokens)."""

    def _check(self) -> list[ConfigProblem]:
        out = []
        usable = (self.num_blocks - 1) * self.block_size
        if self.max_model_len > usable:
            needed = -(-self.max_model_len // self.block_size) + 1
            out.append(
                problem(
                    "max_model_len",
                    f"{self.max_model_len} tokens do not fit the KV cache: {self.num_blocks - 1} usable blocks "
                    f"(block 0 is the null block) x block_size {self.block_size} = {usable}; "
                    f"raise kv_cache.num_blocks to {needed} or lower max_model_len",
                )
            )
        if self.num_slots > INT32_MAX:
            out.append(
                problem(
                    "num_blocks",
                    f"{self.num_blocks} blocks x block_size {self.block_size} = {self.num_slots} slots exceed "
                    f"the int32 range of slot_mapping ({INT32_MAX}); lower kv_cache.num_blocks to at most "
                    f"{INT32_MAX // self.block_size}",
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
class CaptureSectionConfig(Section):
    """The `capture:` section: which graphs to capture and how."""

    _key: ClassVar[str] = "capture"
    mode: Literal["none", "full", "full_decode_only", "piecewise", "full_and_piecewise"] = "full"
    """`none`: always eager; `full`: mixed and uniform-decode keys; `full_decode_only`: uniform only;
    `piecewise`: every step replays graph pieces around the model's `eager_op`s (attention);
    `full_and_piecewise`: uniform decode steps replay full graphs, every other step pieces.
    Case-insensitive, so vLLM's spellings (`FULL`, `FULL_DECODE_ONLY`, `NONE`, `PIECEWISE`,
    `FULL_AND_PIECEWISE`) mean the same."""
    sizes: tuple[int, ...] | Literal["auto"] = "auto"
    """Ascending token counts to capture, or `auto` for `default_capture_sizes(max_size, q)`."""
    max_size: int | None = spec(None, min=1, max=1 << 16)
    """Largest captured token count; bigger steps run eagerly. Null: 64 with `sizes: auto`, the
    largest size of an explicit list. Given together with a list, it must equal the list's
    largest size. At most 65536: the padding table holds one entry per token count."""
    num_warmups: int = spec(1, min=0, max=100)
    """Eager runs of each dummy batch before its capture, after the checked preflight run. At least 1
    on CUDA (lazy initialisation and torch.compile must happen before capture); 0 is for the emulated
    backend."""
    uniform_query_len: int = spec(1, min=1, max=64)
    """Tokens per request in a uniform decode step (> 1 for speculative decoding)."""
    on_error: Literal["raise", "skip"] = "raise"
    """A size that fails to capture: `raise` stops; `skip` records it and runs it eagerly."""

    def __post_init__(self) -> None:
        if isinstance(self.mode, str) and self.mode.lower() in _MODES:
            object.__setattr__(self, "mode", self.mode.lower())
        Section.__post_init__(self)
        if self.max_size is None:
            resolved = DEFAULT_MAX_SIZE if self.sizes == "auto" else max(self.sizes)
            object.__setattr__(self, "max_size", resolved)

    def _check(self) -> list[ConfigProblem]:
        if self.sizes == "auto":
            try:
                default_capture_sizes(
                    DEFAULT_MAX_SIZE if self.max_size is None else self.max_size, self.uniform_query_len
                )
            except ValueError as exc:
                return [problem("max_size", str(exc))]
            return []
        if not self.sizes:
            return [problem("sizes", "is empty; give at least one size, e.g. [1, 2, 4, 8], or auto")]
        # Bounded first: validating builds a padding table as long as the largest size.
        largest = max(self.sizes)
        if self.max_size is not None and largest > self.max_size:
            return [
                problem(
                    "sizes",
                    f"largest size {largest} exceeds capture.max_size {self.max_size}; raise max_size to "
                    f"{largest} (or leave it out) or drop the larger sizes",
                )
            ]
        if largest > 1 << 16:
            return [problem("sizes", f"largest size {largest} is above 65536, the limit of capture.max_size")]
        try:
            CaptureSizes(self.sizes, max(largest, 1))
        except ValueError as exc:
            return [problem("sizes", str(exc))]
        if self.max_size is not None and largest < self.max_size:
            # vLLM refuses the same disagreement: steps between the two would run eagerly.
            return [
                problem(
                    "max_size",
                    f"{self.max_size} is above the largest of capture.sizes {list(self.sizes)}: steps of "
                    f"{largest + 1}-{self.max_size} tokens would run eagerly; leave max_size out (it follows "
                    f"the list), set it to {largest}, or add sizes up to {self.max_size}",
                )
            ]
        return []


_MODES = typing.get_args(typing.get_type_hints(CaptureSectionConfig)["mode"])

CaptureOptions = CaptureSectionConfig
"""Earlier name of `CaptureSectionConfig`, kept so existing imports work."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChecksConfig(Section):
    """Safety checks on every step and after capture."""

    _key: ClassVar[str] = "checks"
    invariants: Literal["off", "basic", "full"] = "basic"
    """`basic` (O(requests), every step), `full` (adds O(tokens) checks), or `off`."""
    verify_replay: bool = True
    """After each capture, replay and compare with eager runs (the dummy batch and a partly
    filled second batch)."""
    atol: float | None = spec(None, min=0)
    """Absolute tolerance of that comparison; null uses torch.testing's default for the dtype."""
    rtol: float | None = spec(None, min=0)
    """Relative tolerance; give both or neither."""
    poison_padding: bool = False
    """Debug: fill the persistent buffers with sentinel garbage before every staging."""
    sync_debug: bool = False
    """CUDA: run warmups under `torch.cuda.set_sync_debug_mode("error")` to name host syncs."""

    def _check(self) -> list[ConfigProblem]:
        if (self.atol is None) != (self.rtol is None):
            return [
                problem(
                    "atol",
                    f"give checks.atol and checks.rtol together or neither; got atol={self.atol}, rtol={self.rtol}",
                )
            ]
        return []

    @property
    def tolerance(self) -> dict[str, float]:
        """Keyword arguments for `torch.testing.assert_close` (empty: its defaults)."""
        return {} if self.atol is None else {"atol": self.atol, "rtol": self.rtol}


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportConfig(Section):
    """Where the capture report goes."""

    _key: ClassVar[str] = "report"
    path: str | None = None
    """Write the `CaptureReport` here (`.json`, `.yaml` or `.yml`), atomically; null: don't."""

    def _check(self) -> list[ConfigProblem]:
        if self.path is not None and Path(self.path).suffix not in (".json", ".yaml", ".yml"):
            return [problem("path", f"must end in .json, .yaml or .yml; got {self.path!r}")]
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
    """`seq_lens` of padded requests; must be >= query_len and <= kv_cache.max_model_len."""
    slot: int = spec(PAD_SLOT_ID, min=INT32_MIN, max=-1)
    """`slot_mapping` of padded tokens: negative, so they never write the KV cache."""
    position: int = spec(0, min=0, max=INT32_MAX)
    """`positions` of padded tokens."""
    token_id: int = spec(0, min=0, max=INT32_MAX)
    """`input_ids` of padded tokens (a valid token id)."""
    block_id: int = spec(0, min=0, max=INT32_MAX)
    """`block_table` entries of padded requests (the null block)."""

    def _check(self) -> list[ConfigProblem]:
        if self.seq_len < self.query_len:
            return [
                problem(
                    "seq_len",
                    f"{self.seq_len} is smaller than padding.query_len {self.query_len}; "
                    "a padded request must satisfy seq_len >= query_len",
                )
            ]
        return []


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "batching": BatchingConfig,
    "kv_cache": KVCacheConfig,
    "capture": CaptureSectionConfig,
    "checks": ChecksConfig,
    "report": ReportConfig,
    "padding": PadRules,
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
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Scheduler limits."""
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    """The paged KV cache."""
    capture: CaptureSectionConfig = field(default_factory=CaptureSectionConfig)
    """What to capture."""
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    """Safety checks."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """Capture report output."""
    padding: PadRules = field(default_factory=PadRules)
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
        if cap.max_size > bat.max_num_tokens:
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
        if pad.token_id >= self.model.vocab_size:
            out.append(
                problem(
                    "padding.token_id",
                    f"{pad.token_id} is not a valid token id (model.vocab_size {self.model.vocab_size})",
                    involves=("model",),
                )
            )
        if pad.block_id >= kv.num_blocks:
            out.append(
                problem(
                    "padding.block_id",
                    f"{pad.block_id} is not a valid block (kv_cache.num_blocks {kv.num_blocks})",
                    involves=("kv_cache",),
                )
            )
        if pad.position >= kv.max_model_len:
            out.append(
                problem(
                    "padding.position",
                    f"{pad.position} is not below kv_cache.max_model_len {kv.max_model_len}",
                    involves=("kv_cache",),
                )
            )
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

    def buffer_specs(self) -> tuple:
        """The `buffers:` list as `graphcap.BufferSpec`s (imported here: config stays torch-free)."""
        from graphcap.inputs import BufferSpec

        return tuple(BufferSpec(*buffer.as_tuple()) for buffer in self.buffers)


def _schedule(cap: CaptureSectionConfig, max_num_tokens: int) -> CaptureSizes:
    sizes = cap.sizes
    if sizes == "auto":
        sizes = default_capture_sizes(cap.max_size, cap.uniform_query_len)
    return CaptureSizes(sizes, max_num_tokens)


def _section_dict(section: Section) -> dict[str, Any]:
    return {f.name: _plain(getattr(section, f.name)) for f in fields(section) if f.init}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return dict(value) if isinstance(value, MappingProxyType) else value
