"""Memory a capture will take, estimated from the config's shapes before anything is built.

`estimate_memory(config)` adds up the weights, the KV cache, the persistent buffers and the
graphs (per key: the forward's activations and its static output), so `graphcap capture`
can refuse a config that cannot fit (host RAM on the CPU, free memory on a GPU) with the
numbers, instead of being killed by the kernel half-way through building the model.

For the built-in `tiny-llama` the arithmetic below mirrors `TinyLlama` (weights, cache,
rotary tables) and its forward (every intermediate it allocates at a key of `T` tokens and
`R` requests). `tests/test_memory.py` compares it with real forwards on the emulated tape,
so a change to the model that the estimate misses fails there. A factory model supplies
its own number: give the factory function an attribute `estimate_memory(config) -> int`
(bytes of everything it allocates, graphs included) or a mapping of named parts to bytes.
Without one only graphcap's own buffers are known, and the estimate says so.

How graph memory adds up depends on the backend:

- `cuda`: every graph of a backend shares one pool, captured largest first, and a graph's
  static output is not kept alive after capture (it is valid until any graph of the pool
  replays), so the pool holds about the largest key's activations and output together. The
  warmups and the verification run eagerly outside the pool: their working set (a key's
  activations; with `checks.verify_replay`, a copy of its output, the comparison and the probe
  results the pass keeps too) is the capture transient. Not measured on a GPU yet (docs/BENCHMARKS.md).
- `emulated`: recording a key keeps every intermediate of its forward until the tape is
  compiled, next to the outputs of the keys captured before it (largest first, so the first
  key's recording is usually the peak); then, with every output held, each key's verification
  copies its output, runs the forward eagerly and compares, beside the eager results of probe
  batches the pass keeps for later keys (`graphcap.capture.references.SharedReferences`). The
  capture transient is that peak above the outputs, which are all that stays between replays.

This module does not import torch (`graphcap sizes` shows the estimate without it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphcap.config.byte_counts import format_bytes

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig

__all__ = ["GraphMemory", "MemoryEstimate", "available_memory", "estimate_memory", "graphs_bytes"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_BUFFER_BYTES = {
    **{"int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1},
    **{"float16": 2, "float32": 4, "float64": 8},
}  # bytes per element of each engine-buffer dtype (`graphcap.config.buffers.BUFFER_DTYPES`)
_DRAW_ON_DEVICE = 200_000_000  # parameters; as graphcap.models.llama draws its weights

# Config keys that size each part, named when the estimate does not fit.
KEYS = {
    "weights": "model.hidden_size, model.num_layers, model.vocab_size, model.dtype",
    "kv_cache": "kv_cache.num_blocks, kv_cache.block_size, model.num_layers, model.num_kv_heads",
    "buffers": "batching.max_num_tokens, batching.max_num_seqs, kv_cache.max_model_len and the buffers: list",
    "graphs": "capture.max_size, kv_cache.max_model_len (the reference attention gathers every key)",
    "model": "the factory's own estimate_memory",
}


@dataclass(frozen=True, slots=True)
class GraphMemory:
    """One key: `activations` the forward's peak live intermediates (eager, replay), `transient`
    the bytes capture holds for a moment (emulated: every intermediate), `output` the static
    output that stays allocated while the graph lives."""

    num_tokens: int
    num_reqs: int
    activations: int
    transient: int
    output: int


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes by part, and the peak they add up to (`total`).

    `parts` holds the memory that stays: `weights`, `kv_cache` (or a factory model's own
    parts), `buffers` and `graphs` (what the captured graphs keep); `build_transient` (while
    the weights are drawn) and `capture_transient` (the capture's peak above the `graphs` part:
    see the module docstring) are held only for a moment, one at a time.
    """

    backend: str
    parts: dict[str, int]
    build_transient: int = 0
    capture_transient: int = 0
    graphs: tuple[GraphMemory, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        """The peak: every part with the capture transient, or the weights while they are drawn (alone then)."""
        return max(self._at_capture(), self._at_build())

    def _at_capture(self) -> int:
        return sum(self.parts.values()) + self.capture_transient

    def _at_build(self) -> int:
        return self.parts.get("weights", 0) + self.build_transient

    def largest_part(self) -> tuple[str, int]:
        """The part that weighs most at the peak (graphs with the capture transient, or the weights being drawn)."""
        if self._at_build() > self._at_capture():
            return "weights", self._at_build()
        parts = dict(self.parts)
        if self.capture_transient:
            parts["graphs"] = parts.get("graphs", 0) + self.capture_transient
        name = max(parts, key=lambda part: parts[part])
        return name, parts[name]

    def name_of(self, part: str) -> str:
        """What the README calls `part`: the `graphs` part is the `graph pool` on CUDA (what the shared
        pool holds) and the `graph outputs` on the emulated backend (what stays between replays)."""
        if part == "graphs":
            return "graph pool" if self.backend == "cuda" else "graph outputs"
        return part.replace("_", " ")

    def describe(self) -> str:
        """One line: the total, then each part (`graphcap sizes` and `capture`'s first log line)."""
        shown = [f"{self.name_of(name)} {format_bytes(size)}" for name, size in self.parts.items()]
        if self.capture_transient:
            shown.append(f"capture transient {format_bytes(self.capture_transient)}")
        if self.build_transient:
            shown.append(f"build transient {format_bytes(self.build_transient)}")
        notes = "".join(f"; {note}" for note in self.notes)
        return f"memory estimate {format_bytes(self.total)} ({', '.join(shown)}; {self.backend} backend{notes})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total,
            "parts": dict(self.parts),
            "build_transient_bytes": self.build_transient,
            "capture_transient_bytes": self.capture_transient,
            "backend": self.backend,
            "notes": list(self.notes),
        }


def estimate_memory(
    config: CaptureConfig,
    *,
    backend: str = "emulated",
    model_estimate: Callable[[Any], int | Mapping[str, int]] | None = None,
    buffers: Iterable[Any] = (),
) -> MemoryEstimate:
    """Estimate the memory of capturing `config` with `backend` (`cuda` or `emulated`).

    `model_estimate(config)` stands in for the model's own parts (a factory model's
    `estimate_memory`); without it a factory model's memory is unknown (noted, counted 0).
    The `buffers` part holds graphcap's staging buffers and every engine buffer: the config's
    `buffers:` list and `buffers` (`BufferSpec`s given to `CaptureManager(buffers=...)`).
    Bytes are exact for weights, KV cache and buffers, and for activations within the
    tolerance `tests/test_memory.py` checks; allocator rounding and library workspaces
    (cuBLAS, a CUDA context) are not included.
    """
    from graphcap.keys import KeyRegistry

    parts: dict[str, int] = {}
    notes: list[str] = []
    build_transient = 0
    registry = KeyRegistry.from_config(config)
    keys = registry.planned
    graphs: tuple[GraphMemory, ...] = ()
    if config.model.factory is None:
        weights, build_transient = _weights(config, backend)
        parts["weights"] = weights
        parts["kv_cache"] = _kv_cache(config)
        rows = config.batching.max_num_seqs
        graphs = tuple(_graph(config, key.num_tokens, key.num_reqs or min(key.num_tokens, rows)) for key in keys)
        if any(key.piecewise for key in keys):
            notes.append(_PIECEWISE_NOTES["cuda" if backend == "cuda" else "emulated"])
    elif model_estimate is not None:
        given = model_estimate(config)
        own = dict(given) if isinstance(given, Mapping) else {"model": given}
        for name, size in own.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"estimate_memory of {config.model.factory} gave {name}={size!r}; expected bytes >= 0")
        parts.update(own)
    else:
        notes.append(f"model {config.model.factory} not estimated (give the factory an estimate_memory attribute)")
    parts["buffers"] = _buffers(config, backend, (*config.buffers, *buffers))
    if config.model.factory is None:  # a factory model's graphs are in its own estimate, or unknown
        parts["graphs"] = graphs_bytes(graphs, backend)
    by_key = dict(zip(keys, graphs))
    order = [key for key in registry.capture_order() if key in by_key]
    kept = _kept_references(config, registry, order, by_key) if config.checks.verify_replay else None
    transient = _capture_transient(config, backend, [by_key[key] for key in order], kept)
    if config.model.factory is None and backend != "cuda" and order:
        # The copy `graphcap.capture.restore` keeps through a pass: the cache's last block (host memory, which
        # the emulated backend's device is). Scratch blocks are an argument of capture(), not counted.
        transient += _kv_cache(config) // (config.kv_cache.num_blocks + 1)
    return MemoryEstimate(backend, parts, build_transient, transient, graphs, tuple(notes))


_PIECEWISE_NOTES = {
    "emulated": "piecewise keys counted as full graphs of their size (an upper bound)",
    "cuda": (
        "piecewise keys counted as full graphs of their size: their pieces share the pool, and the eager ops' "
        "arguments and results live in it unowned; what an eager op allocates while it runs is not counted"
    ),
}


def _kept_references(
    config: CaptureConfig, registry: Any, order: list, graphs: Mapping[Any, GraphMemory]
) -> list[tuple[int, int, int]]:
    """Per key of `order` (capture order): the bytes of probe results kept when its verification begins and while
    its probes run (`graphcap.capture.references.SharedReferences`: each probe batch's real rows of logits, the
    built-in model's output, a row per token, from its first probe while a later key probes it; at most
    `REFERENCE_BYTES` at once), and the bytes of its largest probe's rows."""
    from graphcap.probe import REFERENCE_BYTES, probe_fills, probes_of

    max_model_len = config.kv_cache.max_model_len
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    size: dict[tuple, int] = {}
    largest = []
    for index, key in enumerate(order):
        shape, per_token = registry.capture_shape(key), graphs[key].output // graphs[key].num_tokens
        probes = probes_of(shape, probe_fills(shape, max_model_len=max_model_len), piecewise=key.piecewise)
        for fill, made in probes:
            first.setdefault(made, index)
            last[made] = index
            size[made] = fill.num_tokens * per_token
        largest.append(max(fill.num_tokens for fill, _ in probes) * per_token)
    kept = []
    for index, rows in enumerate(largest):
        before = sum(size[m] for m in first if first[m] < index <= last[m])
        during = before + sum(size[m] for m in first if first[m] == index < last[m])
        kept.append((min(before, REFERENCE_BYTES), min(during, REFERENCE_BYTES), rows))
    return kept


def _capture_transient(
    config: CaptureConfig, backend: str, graphs: list[GraphMemory], references: list[tuple[int, int, int]] | None
) -> int:
    """The capture's peak above what its graphs keep (`graphs_bytes`); `graphs` in capture order, `references`
    per key the probe results kept when its verification begins and while its probes run, and its largest
    probe's rows (`_kept_references`; None: nothing kept).

    A key is verified right after its capture (no engine context, no peers), its dummy batch compared with a
    copy of its last warmup's output kept through the recording, or after the whole pass beside every output
    (an engine context or peers): the peak is the larger of the two orders. A key's dummy batch is compared
    beside the results kept before it; each probe batch (a copy of the padded output replayed, an eager run of
    its real rows, the comparison) beside those kept through the key.
    """
    if not graphs:
        return 0
    verifies = config.checks.verify_replay
    references = references or [(0, 0, 0)] * len(graphs)
    # Verifying a key: a copy of the replayed output, then the eager forward, then the comparison
    # (torch.testing.assert_close holds four more copies of the output while it runs).
    work = [g.output + max(g.activations, 5 * g.output) if verifies else 0 for g in graphs]
    probing = [g.output + max(g.activations, 5 * rows) if verifies else 0 for g, (*_, rows) in zip(graphs, references)]
    kept = [g.output if verifies and config.capture.num_warmups > 0 else 0 for g in graphs]  # the warmup's copy
    before = [was for was, _, _ in references]
    through = [now for _, now, _ in references]
    if backend == "cuda":  # the warmups and the verification allocate outside the pool
        verifying = max(k + max(w + b, p + t) for k, w, p, b, t in zip(kept, work, probing, before, through))
        return max(verifying, max(g.activations for g in graphs))
    held = peak = 0
    for graph, copy, verify, probe, was, now in zip(graphs, kept, work, probing, before, through):
        # beside the outputs captured before it, and (inline) the probe results kept by the keys verified before it
        peak = max(peak, held + copy + graph.transient + was)
        peak = max(peak, held + graph.output + copy + max(verify + was, probe + now))
        held += graph.output
    after = max(max(w + b, p + t) for w, p, b, t in zip(work, probing, before, through))  # verified after the pass
    return max(peak, held + after) - held


def graphs_bytes(graphs: Iterable[GraphMemory], backend: str) -> int:
    """The `graphs` part of an estimate over `graphs`: what they hold together (cuda: one pool; emulated: outputs)."""
    graphs = list(graphs)
    if backend == "cuda":  # one shared pool whose outputs later graphs reuse: the largest key's working set
        return max((g.activations + g.output for g in graphs), default=0)
    return sum(g.output for g in graphs)


def _weights(config: CaptureConfig, backend: str) -> tuple[int, int]:
    """(bytes of parameters and rotary tables, bytes above them while they are drawn).

    Each weight is drawn in float32 (randn, then scaled and shifted: two tensors alive), then cast;
    the largest (the lm head, drawn last) is drawn beside all the others. The rotary angles are
    built in float64 after the weights (angles, cos, sin). The KV cache comes after both.
    """
    m, kv = config.model, config.kv_cache
    s = _DTYPE_BYTES[m.dtype]
    E, D, F, V = m.hidden_size, m.head_dim, m.ffn_size, m.vocab_size
    per_layer = 2 * E + E * (m.num_heads + 2 * m.num_kv_heads) * D + E * m.num_heads * D + 3 * E * F
    params = 2 * V * E + m.num_layers * per_layer + E
    rope = 2 * kv.max_model_len * (D // 2) * s
    largest = max(V * E, E * (m.num_heads + 2 * m.num_kv_heads) * D, 2 * F * E)
    transient = max((8 - s) * largest, 3 * kv.max_model_len * (D // 2) * 8)  # its own bytes are in the weights
    if backend == "cuda" and params > _DRAW_ON_DEVICE:
        transient = (8 - s) * largest  # drawn on the device: the same two float32 tensors, there
    return params * s + rope, transient


def _kv_cache(config: CaptureConfig) -> int:
    m, kv = config.model, config.kv_cache
    # kv_cache: [num_layers, 2, num_kv_heads, num_blocks + 1 (scratch), block_size, head_dim]
    return m.num_layers * 2 * m.num_kv_heads * (kv.num_blocks + 1) * kv.block_size * m.head_dim * _DTYPE_BYTES[m.dtype]


def _buffers(config: CaptureConfig, backend: str, extras: Iterable[Any]) -> int:
    """The packed staging buffer with the engine buffers `extras` (twice on CUDA: pinned host and
    device) and its scratch; each field 64-byte aligned, as `PersistentBuffers` lays them out."""
    T, R = config.batching.max_num_tokens, config.batching.max_num_seqs
    B = config.kv_cache.max_blocks_per_req
    packed = sum(-(-n * 4 // 64) * 64 for n in (R + 1, R, T, T, T, R * B))
    for spec in extras:  # a BufferConfig or a BufferSpec: name, rows, shape, dtype
        rows = {"tokens": T, "reqs": R, "none": 1}[spec.rows]
        packed += -(-rows * math.prod(spec.shape) * _BUFFER_BYTES[spec.dtype] // 64) * 64
    scratch = 4 * T + 8 * T + 4 * (max(T, R) + 1) + 8 * R + 8 * (T + R + 2)  # arrays and row caches
    return packed * (2 if backend == "cuda" else 1) + scratch


def _graph(config: CaptureConfig, T: int, R: int) -> GraphMemory:
    """The tiny-llama forward at `T` tokens and `R` requests (see `TinyLlama.forward`).

    `transient` is every storage the forward's aten ops return, byte for byte, as the emulated
    recording keeps them (the ops' inner scratch is freed before the next op and not counted);
    `activations` the most of them a replay holds at once (every layer's scratch is dead by the next).
    """
    m, kv = config.model, config.kv_cache
    s = _DTYPE_BYTES[m.dtype]
    H, KV, D, E, F, V = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size, m.ffn_size, m.vocab_size
    B = kv.max_blocks_per_req
    L = B * kv.block_size
    half = 0 if s == 4 else 1  # casts to and from float32 that only exist for 16-bit dtypes
    # _paging (int32 inputs): repeats, the token -> request map, padded tables, read rows, the [T, L] masks.
    requests = 4 * R + 4 + 4 * (R + 1) + 8 * (R + 1) + 8 * (R + 1) + 8 * T + 4 + 4 * (R + 1) + 4 * B
    blocks = 4 * (R + 1) * B + 4 * T * B + 16 * KV * T * B  # padded table, each token's blocks, + plane offsets
    visible = 8 * L + 4 * T + 3 * T * L + 8 * T + T + 8 * T  # j, seq lens, masks; write slots
    persistent = requests + blocks + visible + 2 * T * (D // 2) * s + T * E * s  # + rotary rows, h
    # _rms_norm: float32 x^2, mean, + eps, rsqrt, two products; 16-bit: x and weight in float32, cast back.
    norm = 3 * T * E * 4 + 3 * 4 * T + half * (T * E * 4 + E * 4 + T * E * s)
    qkv = T * (H + 2 * KV) * D * s
    rope = 4 * T * (H + KV) * D * s  # four products, two sums (halves), the cat; for q and for k
    gather = 2 * T * KV * D * s + 2 * KV * T * L * D * s  # stacked k, v written; each token's keys and values
    copied = T > 1 and KV > 1  # out.transpose(0, 1).reshape copies unless a dimension is 1
    scores = H * T * L * (s + 4 + half * s) + T * L  # scores, float32 softmax (16-bit: cast back), the mask
    attn_out = T * H * D * s * (2 + copied)  # scaled q, probs @ v, its [T, H*D] copy
    residual = 2 * T * E * s  # o_proj and the sum
    mlp = 2 * T * F * s + 2 * T * F * s + 2 * T * E * s  # gate_up, silu and product, down_proj and the sum
    logits = norm + T * V * s + half * T * V * 4  # lm head, then its float32 copy
    attend = gather + scores + attn_out
    inner = half * H * T * L * 4  # softmax's float32 copy of 16-bit scores, freed inside the op
    activations = persistent + max(norm + qkv + rope + attend + inner, norm + mlp + residual, logits)
    every = persistent + m.num_layers * (2 * norm + qkv + rope + attend + residual + mlp) + logits
    return GraphMemory(T, R, activations, every, T * V * 4)


def available_memory(device: Any) -> tuple[int | None, str]:
    """Bytes the capture may still use on `device` (a `torch.device` or its string), and what they are.

    CUDA: free device memory (`torch.cuda.mem_get_info`). CPU: the host's available memory
    (`MemAvailable`), lowered to the cgroup's remaining limit in a container. None where
    neither is known.
    """
    text = str(device)
    if text.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(text))
        return free, f"free on {text}"
    available, what = None, ""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available, what = int(line.split()[1]) * 1024, "host RAM available (MemAvailable)"
    except OSError:
        pass
    if available is None and hasattr(os, "sysconf"):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            what = "host RAM available"
        except (ValueError, OSError):
            pass
    limit = _cgroup_remaining()
    if limit is not None and (available is None or limit < available):
        available, what = limit, "left under this container's memory limit (cgroup)"
    return available, what


def _cgroup_remaining() -> int | None:
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), g.read().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:  # v1 writes ~2**63 for none
            return max(0, int(limit) - int(usage))
    return None
