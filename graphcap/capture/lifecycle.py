"""A manager's graphs over an engine's life: what freed them, how the KV cache changed, what a re-capture reuses.

Engines do not capture once: they re-capture after a weight swap, give graph memory back while
asleep (`CaptureManager.release()`) and capture again on wake, and re-allocate their KV cache to
more or fewer blocks (`CaptureManager.resize_kv()`). This module holds what those steps need
that is not the manager's own state:

- `PassHistory`: the capture passes of a manager and what freed the graphs before each, for
  the `recapture` entry of a report;
- `resized_config`: the config with a KV-cache group's new block count, validated like any config;
- `check_kv_fits`: a config that names more blocks than a KV cache graphcap can see holds is a
  `ConfigError` naming `kv_cache.num_blocks` and the real count (the built-in model's cache, and
  tensors given to `resize_kv`), not an out-of-bounds index deep inside a forward;
- `KeptOutputs`: the last replay's outputs, kept valid across a `capture_pending()` between steps.

A model shows graphcap its cache through `kv_cache_num_blocks` (an int attribute or property on
the model or any of its submodules: the blocks its cache holds, the null block included), as
the built-in `TinyLlama` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch

from graphcap.backends import CapturedGraph, GraphBackend
from graphcap.capture.outcome import KeyOutcome
from graphcap.checks.guard import StaticGuard
from graphcap.config import CaptureConfig
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.keys import GraphKey, KeyRegistry, StepStats
from graphcap.memory.budget import MemoryBudget
from graphcap.outputs import flatten_output

__all__ = [
    "REUSED",
    "KeptOutputs",
    "LiveGraphs",
    "PassHistory",
    "check_kv_fits",
    "kv_tensors",
    "resize_plan",
    "resized_config",
]

REUSED = ("key schedule", "persistent buffers", "block table rows", "registered statics")
"""What a re-capture keeps from the passes before it (built once per manager, never rebuilt)."""


class LiveGraphs:
    """The graphs a manager serves with (`CaptureManager.graphs` is `graphs`), kept and let go of.

    `install` keeps what a pass produced (`graphcap.capture.capturer.Capturer` runs the pass) and marks the
    registry's keys; `reserve` holds `capture.memory_budget` in the pool; `release_all` frees every
    graph, forgets the guard's records and the registry's capture state, and frees the pool when
    the backend is the manager's own (later captures go to a fresh pool: never into one whose
    graphs were freed); a shared backend's pool rotates only once no graph of any manager uses it.
    """

    def __init__(self, backend: GraphBackend, owns_backend: bool, registry: KeyRegistry, guard: StaticGuard) -> None:
        self.graphs: dict[GraphKey, CapturedGraph] = {}
        self._backend, self._owns_backend, self._registry, self._guard = backend, owns_backend, registry, guard

    def reserve(self, budget: MemoryBudget) -> None:
        """Reserve `budget.limit` in the backend's pool, once (until the graphs are all released).

        A pool that holds as much already (reserved by another manager sharing it) takes nothing more.
        """
        if budget.limit is not None and (self._backend.reserved_bytes or 0) < budget.limit:
            try:
                self._backend.reserve(budget.limit)
            except torch.OutOfMemoryError as exc:  # now, not in a lazy capture later: the point of reserving
                free = self._backend.free_memory()
                raise ConfigError(
                    [
                        ConfigProblem(
                            "capture.memory_budget",
                            f"{budget.limit} bytes could not be reserved on {self._backend.device} (free: "
                            f"{free if free is not None else 'unknown'} bytes; {str(exc).splitlines()[0][:120]}): "
                            "lower the budget or free device memory first",
                        )
                    ]
                ) from exc

    def install(self, outcomes: list[KeyOutcome], graphs: dict[GraphKey, CapturedGraph]) -> None:
        """Keep what a pass produced: its graphs (captured and verified), and the keys it skipped."""
        self.graphs.update(graphs)
        for outcome in outcomes:
            if outcome.key in graphs:
                self._registry.mark_captured(outcome.key)
            elif outcome.status == "skipped":
                self._registry.mark_skipped(outcome.key, outcome.message, outcome.counted_as)

    def release_all(self, reason: str = "not_captured") -> int:
        """Drop every graph (steps then run eagerly with `reason`) and the pool they used; how many."""
        count = len(self.graphs)
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self._registry.reset(reason)
        self._guard.disarm()
        if self._owns_backend:
            self._backend.reset()
        elif not self._backend.graphs:  # no manager's graph is left: the reservation goes back too
            self._backend.pool.release_reservation()
            self._backend.pool.rotate()
        return count


class KeptOutputs:
    """What the last replay returned (views of its graph's static output), kept valid across idle-time capture.

    `execute`'s outputs are valid until the manager's next step. A `capture_pending()` between two
    steps is no step, yet its captures and verification replays may reuse the pool memory those
    views read (on CUDA the new graphs' intermediates land there; the emulated backend NaN-fills
    them). `protected()` copies the views' values aside before and writes back, after, each one
    whose bytes changed: a tensor the captures left alone (a view of a buffer the engine owns, which
    capture writes only in the null and scratch blocks) is never written. Costs one copy of the real
    rows of the last step's outputs per `capture_pending()` call; nothing when the last step ran eagerly.
    Graphs freed (`capture()`, `release()`, `resize_kv()`, `reset()`) take their outputs with them.
    """

    def __init__(self) -> None:
        self._graph: Any = None
        self._output: Any = None

    def hold(self, graph: Any, output: Any) -> None:
        """`output` is what a replay of `graph` returned (called on every replayed step)."""
        self._graph, self._output = graph, output

    def drop(self) -> None:
        """No replay's output is valid any more (an eager step, or the graphs were freed)."""
        self._graph = self._output = None

    @contextmanager
    def protected(self) -> Iterator[None]:
        """Inside, anything may replay or capture; on exit the held outputs read what they read on entry."""
        graph, output = self._graph, self._output
        if graph is None or graph.is_released:
            yield
            return
        leaves = [t for t in flatten_output(output, "the last step")[0] if t.numel()]
        with torch.inference_mode():
            saved = [t.clone() for t in leaves]
        try:
            yield
        finally:
            if not graph.is_released:  # released inside: the views read freed memory, as the contract says
                with torch.inference_mode():
                    for leaf, value in zip(leaves, saved):
                        if not _same_bytes(leaf, value):
                            leaf.copy_(value)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals the same NaN): whether `a` still holds the bytes `b` copied."""
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class PassHistory:
    """The capture passes of one manager, and what freed the graphs before the next one."""

    def __init__(self) -> None:
        self.passes = 0
        """Capture passes completed."""
        self._freed: tuple[str, int] | None = None  # (what freed the last graphs, how many)

    def freed(self, what: str, num_graphs: int, stats: StepStats | None = None) -> int:
        """`what` (`release()`, `resize_kv()`, `reset()`) freed `num_graphs` graphs (counted in `stats`)."""
        self._freed = (what, num_graphs)
        if stats is not None:
            stats.releases += 1
            stats.graphs_released += num_graphs
        return num_graphs

    def completed(self, replaced: int, stats: StepStats | None = None) -> dict[str, Any] | None:
        """A pass completed, having released `replaced` graphs of the one before: its report's `recapture`.

        None for the first pass of the manager. Counted in `stats` (`captures`, `graphs_released`).
        """
        self.passes += 1
        if stats is not None:
            stats.captures += 1
            stats.graphs_released += replaced
        freed, self._freed = self._freed, None
        if self.passes == 1:
            return None
        what, released = ("capture()", replaced) if replaced or freed is None else freed
        return {"pass": self.passes, "after": what, "graphs_released": released, "reused": list(REUSED)}


def resize_plan(
    config: CaptureConfig, model: Any, num_blocks: int, tensors: Any, group: str | None, block_dim: int
) -> tuple[CaptureConfig, dict[str, torch.Tensor]]:
    """What `resize_kv` changes, every check done first: the new config and the named cache tensors."""
    resized = resized_config(config, num_blocks, group)
    named = kv_tensors(tensors)
    check_kv_fits(resized, model, named, block_dim=block_dim, group=group)
    return resized, named


def resized_config(config: CaptureConfig, num_blocks: int, group: str | None = None) -> CaptureConfig:
    """`config` with `kv_cache.num_blocks` (or that of the group named `group`) set to `num_blocks`.

    Validated as a new config: `ConfigError` naming the key for a count that is not an integer,
    too small for `max_model_len`, or an unknown group.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise ConfigError([ConfigProblem("kv_cache.num_blocks", f"must be an integer; got {num_blocks!r}")])
    kv = config.kv_cache
    if group is None:
        return dataclasses.replace(config, kv_cache=dataclasses.replace(kv, num_blocks=num_blocks))
    names = [g.name for g in kv.groups]
    if group not in names:
        known = ", ".join(names) or "none (kv_cache.groups is empty)"
        raise ConfigError([ConfigProblem("kv_cache.groups", f"no group named {group!r}; groups: {known}")])
    index = names.index(group)
    try:
        groups = list(kv.groups)
        groups[index] = dataclasses.replace(groups[index], num_blocks=num_blocks)
    except ConfigError as exc:  # the group checks itself: name its entry
        where = f"kv_cache.groups[{index}]"
        raise ConfigError([p._replace(key=p.key.replace("kv_cache.groups[]", where)) for p in exc.problems]) from None
    return dataclasses.replace(config, kv_cache=dataclasses.replace(kv, groups=tuple(groups)))


def kv_tensors(tensors: Any) -> dict[str, torch.Tensor]:
    """The KV-cache tensors given to `resize_kv` by name: a tensor, a list (`kv_cache.0`, ...) or a mapping."""
    if tensors is None:
        return {}
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if isinstance(tensors, Mapping):
        named = {str(name): t for name, t in tensors.items()}
    elif isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
        named = {f"kv_cache.{i}": t for i, t in enumerate(tensors)}
    else:
        raise TypeError(f"tensors must be a tensor, a list of tensors or a mapping of names to them; got {tensors!r}")
    for name, tensor in named.items():
        if not name:
            raise TypeError(f"tensors must be named by non-empty strings (registered as static.NAME); got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor; got {type(tensor).__name__}")
    return named


def check_kv_fits(
    config: CaptureConfig,
    model: Any,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    block_dim: int = 0,
    group: str | None = None,
) -> None:
    """`ConfigError` naming `kv_cache.num_blocks` when a KV cache graphcap can see holds fewer blocks.

    Seen: the model's (and its submodules') `kv_cache_num_blocks` (the built-in group only), and
    `tensors` whose dim `block_dim` counts blocks (the group `group`, None: the built-in one).
    """
    kv = config.kv_cache
    if group is None:
        num_blocks, key = kv.num_blocks, "kv_cache.num_blocks"
    else:
        index = [g.name for g in kv.groups].index(group)
        # A loaded config gives every group its count (None is refused).
        num_blocks, key = cast(int, kv.groups[index].num_blocks), f"kv_cache.groups[{index}].num_blocks"
    seen = dict(_model_caches(model)) if group is None else {}
    for name, tensor in (tensors or {}).items():
        if not -tensor.dim() <= block_dim < tensor.dim():
            raise ValueError(f"block_dim {block_dim} is not a dim of tensors[{name!r}] (shape {tuple(tensor.shape)})")
        seen[name] = tensor.shape[block_dim]
    small = [(name, count) for name, count in seen.items() if count < num_blocks]
    if small:
        shown = ", ".join(f"{name} holds {count}" for name, count in small)
        raise ConfigError(
            [
                ConfigProblem(
                    key,
                    f"{num_blocks} blocks, but the KV cache is smaller: {shown}; block ids up to {num_blocks - 1} "
                    f"would index past it. Set {key} to at most {min(c for _, c in small)} (resize_kv after "
                    "re-allocating the cache), or allocate the cache with enough blocks",
                )
            ]
        )


def _model_caches(model: Any) -> list[tuple[str, int]]:
    """`(where, blocks)` of every `kv_cache_num_blocks` the model and its submodules declare."""
    found = []
    modules = model.named_modules() if isinstance(model, torch.nn.Module) else [("", model)]
    for path, module in modules:
        count = getattr(module, "kv_cache_num_blocks", None)
        if isinstance(count, int) and not isinstance(count, bool):
            found.append((f"model.{path}.kv_cache" if path else "model.kv_cache", count))
    return found
