"""`kept_blocks`: the KV blocks a capture pass's probes may write, saved before the pass and put back after it.

Verification probes (`graphcap.probe.probe_batch`) write their real tokens' keys and values into the scratch
blocks the engine names (`capture(scratch_blocks=...)`, `group_scratch_blocks`). A free block of a
prefix-caching engine still holds a cached prefix that a later request may hit, so every block a pass may
write is saved when the pass begins and written back, byte for byte, when it ends: on success, on a failure,
and on an interrupt (`KeyboardInterrupt` too). Blocks saved, per KV cache (the built-in one and every
`kv_cache.groups` group):

| block | why |
|---|---|
| the scratch blocks the pass's probes can use | the probes' tokens write them |
| the cache's last block (slot layout: its last `block_size` slots) | what a pad slot of -1 reaches (torch wraps |
| | negative indices) in a kernel that indexes the cache with it |

The null block 0 is graphcap's and not saved. A pass uses at most `T // block_size + 2 R` scratch blocks per
cache (the blocks the real tokens of its largest probe span: each request's tokens start anywhere in a block),
`T` and `R` the largest key's tokens and requests: the rest of a longer list is neither used nor saved, so the
copy costs at most that many blocks of each cache. The copy is kept in host memory (on the emulated backend, the
same memory as the cache), never in device memory; `estimate_memory` counts the last block's copy there.

Which tensors are KV caches is read from their shapes (`graphcap.checks.sampling.locate`) among every tensor the
model holds (`graphcap.checks.statics.held_tensors`: parameters, buffers, plain attributes of its modules, lists
and dicts) and the `register_static` tensors. A cache laid out otherwise is not saved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from graphcap.checks.sampling import Cache, locate
from graphcap.checks.statics import held_tensors

if TYPE_CHECKING:
    from graphcap.capture.parts import CaptureParts
    from graphcap.capture.verifier import Scratch
    from graphcap.keys import GraphKey

__all__ = ["caches_of", "kept_blocks", "probe_block_bound"]

log = logging.getLogger("graphcap")


def probe_block_bound(keys: Iterable[GraphKey], shape_of: Any, block_size: int) -> int:
    """The most scratch blocks of one cache (of `block_size`) a probe of any of `keys` writes: `T // bs + 2 R`.

    A request of `q` tokens starting anywhere in a block spans at most `(q - 1) // bs + 2` blocks; summed over
    `R` requests of `T` tokens that is at most `(T - R) // bs + 2 R`. `shape_of(key)`: the key's capture shape.
    """
    most = 0
    for key in keys:
        shape = shape_of(key)
        most = max(most, shape.num_tokens // block_size + 2 * (shape.num_reqs or shape.num_tokens))
    return most


def caches_of(model: Any, registered: Mapping[str, torch.Tensor], caches: Sequence[tuple]) -> list[Cache]:
    """The KV caches among what `model` holds and the registered tensors (`locate`; `caches`: `(group,
    block_size, num_blocks)` of the built-in cache, group None, and of each group)."""
    tensors = {r.name: r.value for r in held_tensors(model).values()}
    tensors.update({f"static.{name}": tensor for name, tensor in registered.items()})
    return locate(tensors, caches)


@contextmanager
def kept_blocks(
    parts: CaptureParts, scratch: Scratch, keys: Sequence[GraphKey], caches: list[Cache]
) -> Iterator[Scratch]:
    """Save the blocks the probes of `keys` may write in `caches` (of `scratch`, and each cache's last block),
    yield the scratch the pass uses (only as many blocks as its probes can need), and put every saved block back
    when the block exits, however it exits (see the module table).

    A failure to put them back (a CUDA error that ended the pass) is logged, and the exception that ended the
    pass propagates; on success it raises.
    """
    kv = parts.config.kv_cache
    sizes: dict[str | None, int] = {None: kv.block_size, **{g.name: g.block_size for g in parts.kv_groups}}
    used: dict[str | None, tuple[int, ...]] = {}
    for group, blocks in [(None, scratch.blocks), *scratch.groups.items()]:
        bound = probe_block_bound(keys, parts.registry.capture_shape, sizes[group]) if keys else 0
        used[group] = tuple(dict.fromkeys(blocks))[:bound]
    if used[None] != scratch.blocks or any(used[g] != b for g, b in scratch.groups.items()):
        scratch = type(scratch)(used[None], {g: used[g] for g in scratch.groups})
    saved = [_save(cache, used.get(cache.group, ())) for cache in caches] if keys else []
    try:
        yield scratch
    except BaseException:
        try:
            _put_back(saved)
        except Exception:  # the pass's own error says more (a sticky CUDA error fails both)
            log.exception("capture: the KV blocks the pass may have written could not be put back")
        raise
    _put_back(saved)


def _save(cache: Cache, scratch: tuple[int, ...]) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """(cache, index into `cache.view`, the saved values on the host) for `scratch` and the last block."""
    view, bs = cache.view, cache.block_size
    rows = view.shape[0]
    if cache.by_block:
        index = torch.tensor(sorted({*scratch, rows - 1}), dtype=torch.long)
    else:  # the scratch blocks' slots, and the last block_size slots (what negative pad slots reach)
        blocks = torch.tensor(sorted(scratch), dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
        index = torch.cat([slots, torch.arange(max(0, rows - bs), rows)]).unique()
    index = index[index < rows].to(view.device)
    with torch.inference_mode():
        values = view[index].to("cpu")  # advanced indexing copies: never a view of the cache
    return cache, index, values


def _put_back(saved: list[tuple[Cache, torch.Tensor, torch.Tensor]]) -> None:
    with torch.inference_mode():
        for cache, index, values in saved:
            cache.view[index] = values.to(cache.view.device)
