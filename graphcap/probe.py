"""The verification batches (`probe_batch`): partly filled at several fill levels, unlike the dummy batch,
writing no live KV block.

After capture each graph replays batches filled to each of `probe_fills(key)` and is compared
with an eager run of each: fewer real requests and tokens than the key holds (one, about half,
all but one), random ids, context lengths and block tables, so a graph that froze a host value
or lets padded rows leak into real ones is caught whatever the share of padding that shows it.
The batches read live blocks of the built-in KV cache but write only blocks the engine names as
scratch (`scratch_block_ids`), in the built-in cache and in every extra group (`kv_cache.groups`),
or nothing; an extra group's tables name only its scratch blocks, or its null block alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from graphcap.batch import StepBatch
from graphcap.errors import BatchError
from graphcap.keys import GraphKey

if TYPE_CHECKING:
    from graphcap.inputs import KVGroup

__all__ = [
    "REFERENCE_BYTES",
    "Fill",
    "Probe",
    "check_scratch_free",
    "distinct_blocks",
    "group_scratch_ids",
    "probe_batch",
    "probe_fills",
    "probe_batches_run",
    "probe_identity",
    "probes_of",
    "scratch_block_ids",
]


class Probe(NamedTuple):
    """A verification batch and whether its real tokens may write the KV cache."""

    batch: StepBatch
    writes_kv: bool
    """True: every real token writes its own slot, in a block the engine named scratch; False: the
    block table reads live blocks, and staging gives every real token the pad slot (no KV write)."""


class Fill(NamedTuple):
    """The real counts of a verification batch for a key."""

    num_tokens: int
    num_reqs: int

    def is_full(self, key: GraphKey) -> bool:
        """Whether the batch fills every token and request row of `key` (no padded row runs)."""
        return self.num_tokens == key.num_tokens and self.num_reqs == key.num_reqs


def probe_fills(key: GraphKey, *, max_model_len: int) -> tuple[Fill, ...]:
    """The fill levels `key` is verified at: every smaller batch level the key admits, or the full one.

    Tokens at one, about half and all but one of `T` (a mixed key), each with requests at the same
    level of `R` (one; about half, and fewer than the tokens so requests of several tokens run; all
    but one), at least the requests `max_model_len` needs; where none of those has requests of several
    tokens (a key of two or three tokens), all but one token (both of two) over the fewest requests too,
    so an output with a row per request cut as per token shows. A uniform key (`T / R` tokens per
    request) at one, about half and all but one of its requests. Distinct levels, in that order. A key that
    admits no smaller batch (one request of a uniform key, one token of a mixed one) gets its full
    fill alone: it is verified on the full batch only.
    """
    T, R = key.num_tokens, key.num_reqs
    if R is None:
        raise BatchError(
            f"probe_fills({key}): a piecewise key has no request count to fill; "
            "give the key its capture shape (KeyRegistry.capture_shape) instead"
        )
    if key.uniform:
        q = T // R
        levels = [Fill(r * q, r) for r in (1, max(1, R // 2), R - 1) if 1 <= r < R]
    else:
        least = lambda n: -(-n // max_model_len)  # noqa: E731 - the requests n tokens need at least
        levels = []
        if T > 1:
            half = max(1, T // 2)
            levels.append(Fill(1, 1))
            levels.append(Fill(half, min(R, max(least(half), min(max(1, R // 2), max(1, half // 2))))))
            levels.append(Fill(T - 1, min(R, max(least(T - 1), min(max(1, R - 1), T - 1)))))
            # Requests of several tokens, so an output with a row per request cut as per token shows: all
            # but one token (both tokens of a key of two) over the fewest requests.
            n = T - 1 if T > 2 else T
            several = Fill(n, least(n))
            if not any(f.num_tokens > f.num_reqs for f in levels) and several.num_reqs < n and not several.is_full(key):
                levels.append(several)
    out = tuple(dict.fromkeys(levels))
    return out or (Fill(T, R),)


REFERENCE_BYTES = 64 << 20
"""The most bytes of probe batches' eager results one pass keeps for later keys (`graphcap.capture.references`)."""


def probe_identity(key: GraphKey, fill: Fill) -> tuple[int, int, int]:
    """What `probe_batch` draws a fill's batch from: its real tokens and requests, and the tokens of every request
    where they are fixed (a uniform key's `T / R`, one request, one token each), else 0. Not the key's padded
    size: the keys of a pass that probe the same counts probe the same batch, run eagerly once per pass (a batch
    that writes the KV cache excepted: each key's is its own)."""
    num_tokens, num_reqs = fill
    fixed = key.uniform or num_reqs == 1 or num_tokens == num_reqs
    return num_tokens, num_reqs, num_tokens // num_reqs if fixed else 0


def probes_of(shape: GraphKey, fills: Iterable[Fill], *, piecewise: bool = False) -> list[tuple[Fill, tuple]]:
    """Each of `fills` (of `shape`, a key's capture shape: `probe_fills`) with its batch's identity in a pass: what
    `probe_batch` draws it from (`probe_identity`), the key's axis values, and whether the key is piecewise (its
    eager run takes another path). Probes of one pass with one identity probe one batch, unless it writes."""
    return [(fill, (probe_identity(shape, fill), shape.axes, piecewise)) for fill in fills]


def probe_batches_run(keys: Iterable[GraphKey], *, max_model_len: int) -> dict[GraphKey, int]:
    """Per key (`keys` in the order a pass verifies them, each its capture shape with its axes), how many of its probe
    batches no earlier key probed: the eager runs its verification makes when nothing else differs (a pass alone,
    one phase, batches that write nothing, results within the kept bytes)."""
    seen: set = set()
    runs = {}
    for key in keys:
        identities = {made for _, made in probes_of(key, probe_fills(key, max_model_len=max_model_len))}
        runs[key] = len(identities - seen)
        seen |= identities
    return runs


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
    fill: Fill | None = None,
    own: bool = False,
) -> Probe:
    """A verification batch for `key` with `fill`'s real counts (None: the middle of `probe_fills`), unlike
    the dummy batch in every value; `own`: drawn for the key even when it writes no KV block (an engine buffer
    takes its own sampler's values, which may name state the step writes).

    The tokens spread over the requests at random (each at most `max_model_len`; a uniform key's
    requests have `T / R` each); random token ids, context lengths and block tables, drawn from the fill's
    counts and `seed` only, so every key probed at the same counts gets the same batch, unless the batch
    writes (below): then it is drawn for the key too, each key's its own. A graph that
    froze a host value at capture (a Python count, a value read from the host metadata) or lets
    padded rows leak into real ones gives different real rows than an eager run of this batch.

    The probe never writes a KV block that may hold a live request's keys: its context reads
    random blocks (from 1 up, never the null block), and the blocks its tokens are computed in
    come from `scratch_blocks` (blocks the engine says are free) when there are enough of them,
    one slot per token (`writes_kv`). Otherwise those tokens must write nothing: the caller
    stages them with the pad slot (`writes_kv` False). Each extra KV-cache group (`groups`) gets
    its own table naming only blocks graphcap may write: blocks of `group_scratch[name]` (distinct
    while there are enough, its computed tokens' distinct), or, without any, the null block 0 alone, so
    a layout that writes through the table (a state-space group's per-request state at
    `block_table[:, 0]`) writes no live block either; the batch writes slots only when every cache has
    enough scratch, or nothing anywhere.
    """
    if fill is None:
        fills = probe_fills(key, max_model_len=max_model_len)
        fill = fills[len(fills) // 2]
    identity = probe_identity(key, fill)
    caches: list[tuple[str | None, int, int, Sequence[int]]] = [(None, block_size, num_blocks, scratch_blocks)]
    caches += [(g.name, g.block_size, g.num_blocks, (group_scratch or {}).get(g.name, ())) for g in groups]
    probe = _drawn(np.random.default_rng([seed, *identity]), identity, max_model_len, vocab_size, caches)
    if probe.writes_kv or own:
        # A batch that writes is the key's own: the same batch probed by an earlier key would have left the right
        # keys and values in its slots, and a graph that never writes them would read them and pass.
        salt = [key.num_tokens, key.num_reqs or 0, int(key.uniform), len(key.axes), *(value for _, value in key.axes)]
        probe = _drawn(np.random.default_rng([seed, *salt, *identity]), identity, max_model_len, vocab_size, caches)
    return probe


def _drawn(
    rng: np.random.Generator, identity: tuple[int, int, int], max_model_len: int, vocab_size: int, caches: list
) -> Probe:
    """`probe_batch`'s batch of `identity`'s counts drawn from `rng`; `caches`: (group name or None, block size,
    blocks, scratch blocks) of the KV cache and each extra group."""
    num_tokens, num_reqs, fixed = identity
    if fixed:
        q = np.full(num_reqs, fixed, dtype=np.int64)
    else:
        q = np.ones(num_reqs, dtype=np.int64)
        extra = rng.integers(0, num_reqs, num_tokens - num_reqs)
        np.add.at(q, extra, 1)
        while q.max() > max_model_len:  # move tokens of an over-long request to the shortest one
            q[int(np.argmax(q))] -= 1
            q[int(np.argmin(q))] += 1
    context = rng.integers(0, np.maximum(1, max_model_len - q + 1))
    _, block_size, num_blocks, _ = caches[0]
    if (-(-(context + q) // block_size)).sum() > num_blocks - 1:  # too few blocks for random context
        context[:] = 0
    tables: dict[str | None, Any] = {}
    writes = True
    for name, size, count, scratch in caches:
        free = np.unique(np.asarray(scratch, dtype=np.int64))
        # The built-in cache's context reads random blocks (its tokens write only through slot_mapping); a group's
        # table names only blocks graphcap may write (its scratch blocks, else the null block 0): a state-space
        # layout writes each request's state at block_table[:, 0], whatever slot_mapping says.
        own = name is not None and free.size >= int((-(-(q + context) // size)).sum())
        if name is None:
            tables[name] = distinct_blocks(q + context, size, count, rng)
        else:
            tables[name] = _scratch_table(q + context, size, free, rng)
        # The columns each request's computed tokens fall in: [first, last) per request.
        first, last = context // size, -(-(context + q) // size)
        writes = writes and bool(free.size) and int((last - first).sum()) <= free.size
        if writes and not own:  # a table of distinct scratch blocks has its computed columns distinct already
            taken = iter(rng.permutation(free).tolist())
            for i in range(len(q)):
                for j in range(int(first[i]), int(last[i])):
                    tables[name][i, j] = next(taken)
    ids = rng.integers(0, vocab_size, int(q.sum()))
    blocks = tables.pop(None)
    groups = {name: table for name, table in tables.items() if name is not None}
    return Probe(StepBatch(q, q + context, ids, blocks, kv_groups=groups), writes)


def _scratch_table(seq_lens: np.ndarray, block_size: int, free: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A KV-cache group's probe table: each request's blocks drawn from `free` (its scratch blocks), distinct while
    they last and reused from the start after; all the null block 0 when `free` is empty."""
    need = -(-np.asarray(seq_lens, dtype=np.int64) // block_size)
    table = np.zeros((len(need), max(1, int(need.max(initial=1)))), dtype=np.int64)
    if free.size:
        order = rng.permutation(free)
        picks = np.resize(order, int(need.sum()))  # cycles through `order` when it is shorter
        start = 0
        for i, count in enumerate(need.tolist()):
            table[i, :count] = picks[start : start + count]
            start += count
    return table


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
