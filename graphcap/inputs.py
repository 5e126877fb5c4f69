"""What a model's forward sees (`ForwardInputs`), an engine's own buffers (`BufferSpec`), and the staging limits.

`PersistentBuffers.stage` (graphcap.staging) makes `ForwardInputs`, built by keyword from
`graphcap.fields.FIELD_TABLE` plus the engine buffers; `check_invariants` and models read them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from graphcap.config import PadRules
from graphcap.config.buffers import BufferConfig, buffer_problems
from graphcap.fields import COUNT_FIELDS, FIELDS
from graphcap.keys import GraphKey

if TYPE_CHECKING:
    from graphcap.checks.plans import BasicPlan

__all__ = [
    "AxesSampler",
    "BufferSpec",
    "ForwardInputs",
    "HostView",
    "KVGroup",
    "KVGroupView",
    "PreparePhase",
    "Sampler",
    "StagingLimits",
    "prepare_of",
]

PreparePhase = Literal["capture", "replay", "eager"]
"""What a staging feeds, as `model.prepare(inputs, phase)` learns it: a graph being captured or
verified (`capture`), a real step's replay (`replay`), or an eager run (`eager`)."""


Sampler = Callable[[np.random.Generator, int], npt.ArrayLike]
"""`BufferSpec.sample(rng, num_real_rows)`: the real rows of a batch graphcap makes."""


class AxesSampler(Protocol):
    """`BufferSpec.sample(rng, num_real_rows, axes)`: the real rows, given the batch's key-axis values too."""

    def __call__(self, rng: np.random.Generator, num_real_rows: int, /, *, axes: dict[str, int]) -> npt.ArrayLike: ...


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """An engine-declared persistent buffer, staged, padded, checked and uploaded like the built-ins.

    `rows`: `tokens` (one row per padded token), `reqs` (one per padded request), `reqs+1` (a
    cumulative int array of offsets, `query_start_loc`'s shape: FlashInfer's `paged_kv_indptr`,
    flash-attention's `cu_seqlens_k`; a step gives its `num_reqs + 1` real entries) or `none`
    (a fixed-shape tensor given whole every step). `shape`: the trailing dims. `row_dim`:
    where the row axis sits among the dims (0: first; mrope positions `[3, T]` use
    `shape=(3,), row_dim=1`). `pad` fills padded rows (and the whole tensor of a `none`
    buffer a step does not give); a `reqs+1` buffer's pad is the rule of its padded entries, as
    `padding.query_len` is `query_start_loc`'s: each adds `pad` to the entry before it (`"last"`, the
    default 0: the last real entry repeated). The `basic` invariants check a `reqs+1` buffer as they
    check `query_start_loc`: entry 0 is 0, no entry is below the one before, padded entries follow the
    rule. `domain=(low, high)`: the values a float buffer may hold (a probability: `(0, 1)`), within
    which graphcap samples it. `check(host_view, num_real_rows)` runs at the configured
    invariant level (`basic` and `full`) on the staged host rows and raises to refuse them.
    `sample(rng, num_real_rows)`: the real rows of the batches graphcap makes for capture and
    verification (a numpy `Generator`; `num_real_rows` is 0 for a `none` buffer, which returns
    the whole tensor), so verification runs the buffer with real values, not only its pad, and a
    forward that reads it as a host value (frozen at capture) is refused. Without it
    (`sample=None`) a float buffer is sampled within its `domain`, or else around its pad (`pad *
    uniform(0.5, 2)`, or `uniform(0.5, 2)` for a pad of 0), and a bool buffer at random, each verification
    batch unlike the capture's batch in its first real row; an integer buffer holds its pad
    in every row, since an integer may index engine state (a slot, a state row, a LoRA) and a value
    graphcap made up could write what the engine owns or read out of range: give it a `sample`
    whose values name rows the engine lets graphcap write (the capture pass writes what the model
    writes for them). A `sample` with a parameter named `axes` also gets the batch's key-axis values
    (`capture.axes`, a dict) by keyword, so rows that index axis slots (an adapter slot) stay below
    them. `sample="pad"`: every row holds the pad (for a float or bool buffer whose
    values must follow a rule no sampler knows; verification then cannot see it read as a host value).
    """

    name: str
    rows: Literal["tokens", "reqs", "reqs+1", "none"]
    shape: tuple[int, ...] = ()
    dtype: str = "int32"
    pad: int | float | bool | Literal["last"] = 0
    row_dim: int = 0
    check: Callable[[np.ndarray, int], Any] | None = field(default=None, compare=False)
    sample: Sampler | AxesSampler | Literal["pad"] | None = field(default=None, compare=False)
    domain: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        problems = buffer_problems(self.name, self.rows, self.shape, self.dtype, self.pad, self.row_dim, self.domain)
        if self.check is not None and not callable(self.check):
            problems.append(("check", f"must be callable(host_view, num_real_rows); got {type(self.check).__name__}"))
        if self.sample is not None and self.sample != "pad" and not callable(self.sample):
            problems.append(
                ("sample", f"must be callable(rng, num_real_rows), 'pad' or None; got {type(self.sample).__name__}")
            )
        if problems:
            detail = "; ".join(f"{key}: {message}" for key, message in problems)
            raise ValueError(f"BufferSpec {self.name!r}: {detail}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.rows == "reqs+1" and self.pad == "last":
            object.__setattr__(self, "pad", 0)  # one spelling of the rule: a declaration in YAML compares alike
        if self.domain is not None:
            object.__setattr__(self, "domain", (float(self.domain[0]), float(self.domain[1])))

    @classmethod
    def from_config(cls, entry: BufferConfig) -> BufferSpec:
        """The spec an entry of the YAML `buffers:` list declares (it has no `check` or `sample`)."""
        name, rows, shape, dtype, pad, row_dim, domain = entry.as_tuple()
        return cls(name, rows, shape, dtype, pad, row_dim, domain=domain)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def is_cumulative(self) -> bool:
        """A `reqs+1` buffer: offsets checked and padded as `query_start_loc` is."""
        return self.rows == "reqs+1"

    @property
    def is_sampled(self) -> bool:
        """Whether graphcap's capture and verification batches hold sampled rows (not the pad) of this buffer."""
        if self.sample is None:
            return self.np_dtype.kind in "fb"
        return self.sample != "pad"


class KVGroup(NamedTuple):
    """An extra KV-cache group as staging sees it (from `kv_cache.groups`)."""

    name: str
    block_size: int
    num_blocks: int
    """Blocks of the group's cache, its null block 0 included."""
    max_blocks_per_req: int
    """Columns of its block table."""
    sliding_window: int | None = None
    """`kv_cache.groups[].sliding_window`: for the model, and for the null-block read rule of the `full` invariants."""

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def table_field(self) -> str:
        """The name of its block table among the static inputs (`ForwardInputs.tensors()`)."""
        return f"kv_groups.{self.name}.block_table"

    @property
    def slots_field(self) -> str:
        """The name of its slot mapping among the static inputs."""
        return f"kv_groups.{self.name}.slot_mapping"


class KVGroupView(NamedTuple):
    """One extra KV-cache group's rows of a step.

    `inputs.kv_groups[name]` holds device tensors, `inputs.host.kv_groups[name]` numpy rows.
    """

    block_table: Any  # [R, max_blocks_per_req] int32: the group's block ids, the null block 0 in padded rows
    slot_mapping: Any  # [T] int32: block * block_size + offset in the group's cache; the pad slot for padded tokens
    block_size: int
    sliding_window: int | None


class HostView(NamedTuple):
    """Numpy views of the staged rows on the host (the rows `ForwardInputs` exposes)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R+1]
    seq_lens: np.ndarray  # [R]
    block_table: np.ndarray  # [R, B]
    extras: Mapping[str, np.ndarray] = MappingProxyType({})
    """Engine buffers (`BufferSpec`) by name, padded rows included."""
    kv_groups: Mapping[str, KVGroupView] = MappingProxyType({})
    """Extra KV-cache groups by name (numpy rows)."""


@dataclass(frozen=True, slots=True)
class StagingLimits:
    """Bounds the staged values must respect (None: unknown, not checked)."""

    block_size: int
    max_blocks_per_req: int
    num_blocks: int | None
    vocab_size: int | None
    max_model_len: int | None
    pad: PadRules
    extras: tuple[BufferSpec, ...] = ()
    """The engine's buffers: their pad values and checks."""
    kv_groups: tuple[KVGroup, ...] = ()
    """The extra KV-cache groups (`kv_cache.groups`)."""

    @property
    def num_slots(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size


@dataclass(slots=True)
class ForwardInputs:
    """What `model.forward` receives: views of the persistent tensors for one key.

    Tensor rows cover the padded shape (`T = key.num_tokens`, `R = key.num_reqs`, or the
    step's own request count for a key of any request count); only the first `num_tokens`
    tokens and `num_reqs` requests are real. Padded tokens after
    `query_start_loc[num_reqs]` belong to no real request: a forward must give them a sink
    and never slice by the Python counts (a graph freezes them). The views alias persistent
    storage: they stay valid, and keep their addresses, for the life of the buffers, and
    the next `stage` overwrites them. A model must not resize or replace them.

    `num_tokens_device` and `num_reqs_device` are the real counts as 0-dim int32 tensors staged with
    the rows (the Python `num_tokens` and `num_reqs` are frozen into a graph at capture; these are
    not): `padding_mask()` derives from them which rows are padding, without a host sync.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32, PAD_SLOT_ID for tokens that must not write the cache
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [R] int32, total lengths including this step
    block_table: torch.Tensor  # [R, max_blocks_per_req] int32
    num_tokens_device: torch.Tensor  # [] int32: num_tokens, on the device; a replay reads the step's own
    num_reqs_device: torch.Tensor  # [] int32: num_reqs, on the device; a replay reads the step's own
    num_tokens: int
    num_reqs: int
    key: GraphKey
    host: HostView
    limits: StagingLimits
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Engine buffers (`BufferSpec`) by name: views of their padded rows."""
    kv_groups: Mapping[str, KVGroupView] = field(default_factory=dict)
    """Extra KV-cache groups (`kv_cache.groups`) by name: each one's `block_table` and `slot_mapping`."""
    basic_plan: BasicPlan | None = field(default=None, init=False, repr=False, compare=False)
    """graphcap's own cache (`graphcap.checks.plans`): the views and expected bytes of this step's basic rules."""
    cumulative_plan: Any = field(default=None, init=False, repr=False, compare=False)
    """graphcap's own cache (`graphcap.checks.invariants`): the same for each cumulative (`reqs+1`) engine buffer,
    by name."""

    @property
    def axes(self) -> dict[str, int]:
        """The key's axis values by name (`capture.axes`; empty without axes): constants of the graph a
        forward is captured into, which may shape its Python-level structure (a loop over adapter slots).
        Slots beyond the step's own value are padding: the forward must leave real rows unchanged by them."""
        return dict(self.key.axes)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The static input tensors by name (built-ins in packed order, then the extras)."""
        out = {name: getattr(self, name) for name in (*FIELDS, *COUNT_FIELDS)}
        out.update(self.extras)
        for group in self.limits.kv_groups:
            view = self.kv_groups[group.name]
            out[group.table_field], out[group.slots_field] = view.block_table, view.slot_mapping
        return out

    def padding_mask(self, rows: Literal["tokens", "reqs"] = "tokens") -> torch.Tensor:
        """Bool `[T]` (`rows="tokens"`) or `[R]` (`"reqs"`): True for padded rows, False for real ones.

        Computed on the device from `num_tokens_device` / `num_reqs_device`: no host sync, so a graph
        captures it and every replay's mask follows that step's counts. A mixture-of-experts layer keeps
        padded tokens out of routing with it (vLLM's `is_padding`, SGLang's `num_token_non_padded`).
        `"reqs"` has the step's request rows, which a piecewise key does not fix: there only an
        `eager_op` may ask for it (the token mask is fine anywhere).
        """
        if rows == "tokens":
            like, count = self.input_ids, self.num_tokens_device
        elif rows == "reqs":
            like, count = self.seq_lens, self.num_reqs_device
        else:
            raise ValueError(f"padding_mask(rows=...) takes 'tokens' or 'reqs'; got {rows!r}")
        return torch.arange(like.shape[0], dtype=torch.int32, device=like.device) >= count


def prepare_of(model: Any) -> Callable[[ForwardInputs, PreparePhase], None] | None:
    """`model.prepare`, called as `prepare(inputs, phase)`; the earlier `prepare(inputs, capturing)` is refused."""
    prepare: Callable[[ForwardInputs, PreparePhase], None] | None = getattr(model, "prepare", None)
    if prepare is None:
        return None
    if not callable(prepare):
        raise TypeError(f"model.prepare must be callable(inputs, phase); got {type(prepare).__name__}")
    try:
        parameters = inspect.signature(prepare).parameters
    except (TypeError, ValueError):  # a builtin or C callable: trust it
        return prepare
    if "capturing" in parameters or "replay" in parameters:
        raise TypeError(
            f"{type(model).__name__}.prepare takes 'capturing'/'replay': the model protocol is now "
            "prepare(inputs, phase) with phase 'capture' (a graph being captured or verified), 'replay' "
            "(a real step's replay) or 'eager'; the old `capturing` is phase == 'capture'"
        )
    return prepare
