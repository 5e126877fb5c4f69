"""The sections of a config beside `model:`: frozen dataclasses, validated on construction.

Every section checks its own fields in `__post_init__` (types, ranges, choices) and then
its cross-field rules in `_check`, raising `ConfigError` listing every problem with its
dotted key. The root `CaptureConfig` (`root.py`) checks what spans sections.

Naming: the root is `CaptureConfig` (DESIGN's public name), so the `capture:` section's
class is `CaptureSectionConfig`; the `padding:` section is `PadRules`, the name engines
use for it. Every other section is `<Name>Config`.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal

from graphcap.config._schema import Section, problem, spec
from graphcap.config.axes import axes_problems, combination_problems
from graphcap.config.byte_counts import MAX_BYTES, parse_bytes
from graphcap.errors import ConfigProblem
from graphcap.fields import INT32_MAX, INT32_MIN
from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes

__all__ = [
    "DEFAULT_MAX_PADDING_FACTOR",
    "DEFAULT_MAX_SIZE",
    "PAD_SLOT_ID",
    "BatchingConfig",
    "CaptureSectionConfig",
    "KVCacheConfig",
    "KVGroupConfig",
    "PadRules",
]

PAD_SLOT_ID = -1
"""`slot_mapping` value of a token that must not write the KV cache."""

DEFAULT_MAX_SIZE = 64
DEFAULT_MAX_PADDING_FACTOR = 4.0
"""`capture.max_padding_factor` by default (tools/bench_padding_factor.py, docs/BENCHMARKS.md)."""
"""`capture.max_size` when neither it nor an explicit `capture.sizes` list is given."""


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
class KVGroupConfig(Section):
    """One extra KV-cache group (an entry of `kv_cache.groups`): its own blocks, block table and slots.

    Hybrid models keep several groups (sliding-window and full attention layers, attention and
    state-space layers), each paged with its own block size. A group's block table has
    `ceil(kv_cache.max_model_len / block_size)` columns; its block 0 is its null block.
    """

    _key: ClassVar[str] = "kv_cache.groups[]"
    name: str = ""
    """Names `ForwardInputs.kv_groups[name]` and `StepBatch(kv_groups={name: ...})`; a Python identifier."""
    block_size: int = spec(16, min=1, max=1 << 16)
    """Token slots per block of this group (at most 65536)."""
    num_blocks: int | None = spec(None, min=2, max=INT32_MAX)
    """Blocks of this group's cache, its null block 0 included. Required: a group's cache is its own,
    sized apart from `kv_cache.num_blocks` (no default could be right; give the built-in group's
    count explicitly when the caches match)."""
    sliding_window: int | None = spec(None, min=1, max=1 << 24)
    """Tokens a layer of this group attends back, null for all: a note the model reads
    (`inputs.kv_groups[name].sliding_window`). The engine frees blocks that fall out of the window
    and points their columns at the null block; staging needs only the block the window ends in."""

    def _check(self) -> list[ConfigProblem]:
        out = []
        if not self.name.isidentifier():
            out.append(
                problem("name", f"must be a Python identifier (it names inputs.kv_groups[...]); got {self.name!r}")
            )
        if self.num_blocks is None:
            out.append(
                problem(
                    "num_blocks",
                    f"is required for group {self.name!r}: the blocks of its own cache, null block 0 included (it "
                    "is not kv_cache.num_blocks; write that count here when both caches hold as many blocks)",
                )
            )
        elif self.num_blocks * self.block_size > INT32_MAX:
            out.append(problem("num_blocks", f"{self.num_blocks} blocks x block_size {self.block_size} exceed the "
                               f"int32 range of slot_mapping ({INT32_MAX})"))  # fmt: skip
        return out

    def max_blocks_per_req(self, max_model_len: int) -> int:
        """Columns of the group's block table: `ceil(max_model_len / block_size)`."""
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheConfig(Section):
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots each.

    Block 0 is the null block: padded rows point at it and dummy runs write into it, so
    an engine must never hand block 0 to a live request. These keys are the first KV-cache
    group (`ForwardInputs.block_table`, `slot_mapping`); `groups` lists the others.
    """

    _key: ClassVar[str] = "kv_cache"
    block_size: int = spec(16, min=1, max=1 << 16)
    """Token slots per block (at most 65536)."""
    num_blocks: int = spec(256, min=2, max=INT32_MAX)
    """Blocks in the cache, the null block 0 included."""
    max_model_len: int = spec(512, min=1, max=1 << 24)
    """Longest sequence (prompt + generated) one request may reach (at most 16777216 tokens)."""
    groups: tuple[KVGroupConfig, ...] = ()
    """Further KV-cache groups (hybrid models), each staged, padded and checked like the first."""

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
        return out + self._group_problems()

    def _group_problems(self) -> list[ConfigProblem]:
        """Each group's name is its own; its cache holds one request of max_model_len (or one window)."""
        out: list[ConfigProblem] = []
        seen: dict[str, int] = {}
        for i, group in enumerate(self.groups):
            where = f"kv_cache.groups[{i}]"
            if group.name in seen:
                out.append(
                    problem(f"{where}.name", f"{group.name!r} is declared twice (also groups[{seen[group.name]}])")
                )
            seen.setdefault(group.name, i)
            span = self.max_model_len if group.sliding_window is None else min(group.sliding_window, self.max_model_len)
            need = -(-span // group.block_size) + (group.sliding_window is not None) + 1  # a window straddles one more
            if group.num_blocks is not None and group.num_blocks < need:  # None: refused by the group
                what = "max_model_len" if group.sliding_window is None else f"a sliding window of {span}"
                message = (
                    f"{group.num_blocks} blocks of {group.block_size} slots cannot hold one request's {what} "
                    f"tokens plus the null block 0: raise it to {need}"
                )
                out.append(problem(f"{where}.num_blocks", message))
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
    strategy: Literal["upfront", "lazy"] = "upfront"
    """`upfront`: `capture()` captures every key before the first step; `lazy`: the manager serves at once
    (uncaptured keys run eagerly, reason `pending`) and `capture_pending()` captures keys in idle time."""
    memory_budget: int | str | None = spec(None, check=lambda budget: _budget_problem(budget))
    """Bytes the graphs may hold (`4GiB`, `512MiB` or an integer), by graphcap's estimate; a key that would
    cross it is not captured (eager reason `over_budget`). Null: no budget."""
    capture_error_mode: Literal["thread_local", "global", "relaxed"] = "thread_local"
    """CUDA: what `CUDAGraph.capture_begin` is given. `thread_local` (default): CUDA work another thread
    issues during a capture (an engine's output or scheduler thread) does not invalidate it, what capture
    inside a living engine needs; `global`: it does (the stricter check, for an engine with no other
    CUDA thread); `relaxed`: even the capturing thread may make unsafe calls (debugging only)."""
    min_speedup: float | None = spec(None, gt=0)
    """Keep a graph only if its replay is at least this many times faster than eager at capture (else it
    is released, eager reason `no_speedup`). Null: keep every graph."""
    num_threads: int | None = spec(None, min=1, max=1024)
    """torch CPU threads while the emulated backend captures (set for each pass, restored after it). Null:
    `EMULATED_CAPTURE_THREADS` (1: measured faster than torch's default on a shared 2-core machine); the
    cuda backend leaves torch's setting alone."""
    max_padding_factor: float | None = spec(DEFAULT_MAX_PADDING_FACTOR, min=1)
    """A step whose graph would compute more than this many times its real tokens runs eagerly instead
    (eager reason `over_padding`): with sizes [1, 32] a 2-token step would replay 32 tokens. The default
    never triggers on the default schedule (it pads at most 1.8x; 4x with `uniform_query_len` 4); null:
    any padding replays."""
    axes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Key axes beyond tokens (`graphcap.config.axes`): an axis name (a Python identifier: `lora`, `ubatch`)
    to its captured values (ascending unique integers >= 0). Every token key is captured at every combination
    of values; a step states its values (`StepBatch(axes={"lora": 3})`; a missing axis is its smallest
    value), each padded to the smallest captured value at or above it; above the largest the step runs
    eagerly (eager reason `above_max_axis.NAME`). The model reads its key's values in `inputs.axes`."""
    axis_combinations: tuple[Mapping[str, int], ...] = ()
    """The combinations of axis values to capture, each a mapping giving every axis one of its values
    (`{lora: 4, ubatch: 2}`); empty: every combination. A step's padded values replay the listed combination
    that holds them with the fewest padded slots, or run eagerly (eager reason `no_axis_combination`)."""

    def __post_init__(self) -> None:
        if isinstance(self.mode, str) and self.mode.lower() in _MODES:
            object.__setattr__(self, "mode", self.mode.lower())
        if isinstance(self.memory_budget, str):  # a size such as 4GiB: bytes from here on
            with contextlib.suppress(ValueError):  # `_check` names the key and the value
                object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        Section.__post_init__(self)
        if self.max_size is None:
            resolved = DEFAULT_MAX_SIZE if self.sizes == "auto" else max(self.sizes)
            object.__setattr__(self, "max_size", resolved)
        # read-only, each axis's values a tuple (to_dict lists them)
        object.__setattr__(self, "axes", MappingProxyType({name: tuple(v) for name, v in self.axes.items()}))
        entries = tuple(MappingProxyType(dict(entry)) for entry in self.axis_combinations)
        object.__setattr__(self, "axis_combinations", entries)

    def _check(self) -> list[ConfigProblem]:
        return (
            axes_problems(self.axes)
            or combination_problems(self.axes, self.axis_combinations)
            or self._sizes_problems()
        )

    def _sizes_problems(self) -> list[ConfigProblem]:
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


def _budget_problem(budget: int | str | None) -> str:
    """`capture.memory_budget`'s own rule: bytes in [1, MAX_BYTES) once a size word was parsed."""
    if isinstance(budget, str) or (budget is not None and not 1 <= budget < MAX_BYTES):
        shown = repr(budget) if isinstance(budget, str) else str(budget)
        return f"expected bytes >= 1 or a size such as 4GiB or 512MiB; got {shown}"
    return ""


_MODES = typing.get_args(typing.get_type_hints(CaptureSectionConfig)["mode"])


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
