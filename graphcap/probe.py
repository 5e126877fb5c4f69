"""The verification batch (`probe_batch`): partly filled, unlike the dummy batch, writing no live KV block.

After capture each graph replays a second batch and is compared with an eager run of it: fewer
real requests and tokens than the key holds, random ids, context lengths and block tables, so
a graph that froze a host value or lets padded rows leak into real ones is caught. The batch
reads live blocks but writes only blocks the engine names as scratch (`scratch_block_ids`), in
the built-in KV cache and in every extra group (`kv_cache.groups`), or nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from graphcap.batch import StepBatch
from graphcap.inputs import KVGroup
from graphcap.keys import GraphKey

__all__ = ["Probe", "check_scratch_free", "distinct_blocks", "group_scratch_ids", "probe_batch", "scratch_block_ids"]


class Probe(NamedTuple):
    """A verification batch and whether its real tokens may write the KV cache."""

    batch: StepBatch
    writes_kv: bool
    """True: every real token writes its own slot, in a block the engine named scratch; False: the
    block table reads live blocks, and staging gives every real token the pad slot (no KV write)."""


def probe_batch(
    key: GraphKey,
    *,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    seed: int = 0,
    scratch_blocks: Sequence[int] = (),
    groups: Sequence[KVGroup] = (),
    group_scratch: Mapping[str, Sequence[int]] | None = None,
) -> Probe:
    """A second verification batch for `key`: partly filled, unlike the dummy batch in every value.

    Fewer real requests than `R` wherever the key allows, so padded rows exist, and for mixed keys
    fewer tokens than `T` (from `T = 3`) over fewer requests than tokens (an output with a row per
    request cut as per token shows); random token ids, context lengths and block tables. A graph
    that froze a host value at capture (a Python count, a value read from the host metadata)
    or lets padded rows leak into real ones gives different real rows than an eager run of
    this batch.

    The probe never writes a KV block that may hold a live request's keys: its context reads
    random blocks (from 1 up, never the null block), and the blocks its tokens are computed in
    come from `scratch_blocks` (blocks the engine says are free) when there are enough of them,
    one slot per token (`writes_kv`). Otherwise those tokens must write nothing: the caller
    stages them with the pad slot (`writes_kv` False). Each extra KV-cache group (`groups`) gets
    its own random table the same way, its computed tokens in `group_scratch[name]`; the batch
    writes only when every cache has enough scratch, or nothing anywhere.
    """
    rng = np.random.default_rng([seed, key.num_tokens, key.num_reqs, int(key.uniform)])
    T, R = key.num_tokens, key.num_reqs
    if key.uniform:
        q_len = T // R
        q = np.full(max(1, R - 1), q_len, dtype=np.int64)
    else:
        num_tokens = T - max(1, T // 4) if T > 2 else T
        num_reqs = min(max(1, R - max(1, R // 3)), max(1, num_tokens // 2)) if R > 1 else 1
        num_reqs = max(num_reqs, -(-num_tokens // max_model_len))
        num_tokens = min(num_tokens, num_reqs * max_model_len)
        q = np.ones(num_reqs, dtype=np.int64)
        extra = rng.integers(0, num_reqs, num_tokens - num_reqs)
        np.add.at(q, extra, 1)
        while q.max() > max_model_len:  # move tokens of an over-long request to the shortest one
            q[int(np.argmax(q))] -= 1
            q[int(np.argmin(q))] += 1
    context = rng.integers(0, np.maximum(1, max_model_len - q + 1))
    if (-(-(context + q) // block_size)).sum() > num_blocks - 1:  # too few blocks for random context
        context[:] = 0
    caches = [(None, block_size, num_blocks, scratch_blocks)]
    caches += [(g.name, g.block_size, g.num_blocks, (group_scratch or {}).get(g.name, ())) for g in groups]
    tables, writes = {}, True
    for name, size, count, scratch in caches:
        tables[name] = distinct_blocks(q + context, size, count, rng)
        # The columns each request's computed tokens fall in: [first, last) per request.
        first, last = context // size, -(-(context + q) // size)
        free = np.unique(np.asarray(scratch, dtype=np.int64))
        writes = writes and bool(free.size) and int((last - first).sum()) <= free.size
        if writes:
            taken = iter(rng.permutation(free).tolist())
            for i in range(len(q)):
                for j in range(int(first[i]), int(last[i])):
                    tables[name][i, j] = next(taken)
    ids = rng.integers(0, vocab_size, int(q.sum()))
    blocks = tables.pop(None)
    return Probe(StepBatch(q, q + context, ids, blocks, kv_groups=tables), writes)


def scratch_block_ids(blocks: Any, num_blocks: int, what: str = "scratch_blocks") -> tuple[int, ...]:
    """`blocks` (an engine's free block ids, given as `capture(scratch_blocks=...)`) checked and as ints.

    `TypeError` for anything but a collection of integers; `ValueError` naming a block outside
    `[1, num_blocks)` (block 0 is the null block, which capture writes anyway).
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
        raise TypeError(f"{what} must be a list of block ids; got {type(blocks).__name__}")
    out = []
    for block in blocks:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 1 <= block < num_blocks:
            raise ValueError(
                f"{what} holds {block!r}; scratch blocks are ids of free KV-cache blocks in "
                f"[1, {num_blocks}) (the cache's num_blocks; block 0 is the null block, written anyway)"
            )
        out.append(int(block))
    return tuple(out)


def group_scratch_ids(blocks: Any, groups: Sequence[KVGroup]) -> dict[str, tuple[int, ...]]:
    """`capture(group_scratch_blocks=...)` checked: a mapping of group names to free block ids of that group."""
    if blocks is None:
        return {}
    if not isinstance(blocks, Mapping):
        raise TypeError(f"group_scratch_blocks must map group names to block ids; got {type(blocks).__name__}")
    by_name = {g.name: g for g in groups}
    out = {}
    for name, ids in blocks.items():
        if name not in by_name:
            known = ", ".join(by_name) or "none"
            raise ValueError(f"group_scratch_blocks names group {name!r}; groups (kv_cache.groups): {known}")
        out[name] = scratch_block_ids(ids, by_name[name].num_blocks, f"group_scratch_blocks[{name!r}]")
    return out


def check_scratch_free(
    scratch: Sequence[int], group_scratch: Mapping[str, Sequence[int]], table: Any, group_tables: Mapping[str, Any]
) -> None:
    """`ValueError` naming the row when a scratch block is held by a row of a persistent block table.

    `table`: the manager's `BlockTable` (`manager.block_table`); `group_tables`: each KV-cache group's. A
    block a live row holds is not free: verification would overwrite that request's keys and values.
    Checked before a capture pass writes anything.
    """
    cases = [("scratch_blocks", "the persistent block table (manager.block_table)", scratch, table)]
    cases += [
        (f"group_scratch_blocks[{name!r}]", f"KV-cache group {name!r}'s block table (manager.kv_group_tables"
         f"[{name!r}])", blocks, group_tables[name])
        for name, blocks in group_scratch.items()
    ]  # fmt: skip
    for what, where, blocks, rows in cases:
        held = rows.holding(blocks) if blocks else None
        if held is not None:
            row, block = held
            raise ValueError(
                f"{what} holds block {block}, which row {row} of {where} holds: a live request's KV blocks are "
                "not scratch (verification would overwrite them); pass only free block ids, or clear the row first"
            )


def distinct_blocks(seq_lens: np.ndarray, block_size: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """A block table giving every request its own blocks (random, never the null block 0).

    Request i gets `ceil(seq_lens[i] / block_size)` blocks, so no two tokens share a KV slot.
    When the cache has fewer blocks than that in all, blocks are reused from the start (a test
    batch on a tiny cache; its slots may then collide).
    """
    need = -(-np.asarray(seq_lens, dtype=np.int64) // block_size)
    usable = num_blocks - 1
    table = np.zeros((len(need), max(1, int(need.max(initial=1)))), dtype=np.int64)
    order = rng.permutation(usable) + 1
    start = 0
    for i, count in enumerate(need.tolist()):
        taken = order[start : start + count] if start + count <= usable else order[:count]
        table[i, :count] = taken
        start += count
    return table
