"""Where a step's real tokens write a paged KV cache, and the rows of every extra KV-cache group.

The `full` invariants of a paged cache, for the built-in one (`slot_mapping`, `block_table`) and
each group of `kv_cache.groups` alike: a real token writes the slot of its own request's block
at its position, never the null block 0 (which padded rows and dummy runs share), and no two
tokens of a step write one slot. Group rows are also held to the pad rules (`basic`: padded
slots are the pad slot; `full`: block ids in range, padded table rows the pad block).
`check_invariants` calls these; vectorized, O(tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from graphcap.errors import InvariantViolation

if TYPE_CHECKING:  # numpy alone at run time (`graphcap inspect` re-checks without torch)
    from graphcap.inputs import ForwardInputs

__all__ = ["check_group_rows", "check_writes"]


def check_writes(
    slots: np.ndarray,
    positions: np.ndarray,
    table: np.ndarray,
    lens: np.ndarray,
    block_size: int,
    key: Any,
    *,
    dummy: bool,
    names: tuple[str, str] = ("slot_mapping", "block_table"),
    seq_lens: np.ndarray | None = None,
    window: int | None = None,
) -> None:
    """Real tokens (`slots`, `positions`: [n]) write their own request's block, never block 0 or one slot twice.

    `lens`: the real requests' query lengths; `table`: the step's block table rows; `names`: how
    errors name the slots and the table. `dummy`: a batch graphcap made, whose requests share
    the null block by design (only the own-block rule applies). `seq_lens` (the real requests'):
    no column a request reads or writes holds the null block; with a sliding `window`, a request
    reads from its first query token's window on (positions `>= seq_len - query_len - window + 1`),
    and columns wholly before it may hold block 0 (an engine gives those blocks back).
    """
    n = len(slots)
    if not n:
        return
    slot_name, table_name = names
    bs = block_size
    slots, positions = slots.astype(np.int64), positions.astype(np.int64)
    width = table.shape[1] * bs
    if positions.max() >= width:
        t = int(np.argmax(positions >= width))
        _fail("positions", t, f"< {width}", int(positions[t]), f"a position lies within {table_name}'s columns", key)
    req = np.repeat(np.arange(len(lens)), lens)  # req: [n], the request of each real token
    blocks = table[req, positions // bs].astype(np.int64)  # the block each token's position lies in
    expected = blocks * bs + positions % bs
    bad = np.flatnonzero(slots != expected)
    if bad.size:
        t = int(bad[0])
        _fail(
            slot_name, t, int(expected[t]), int(slots[t]),
            f"a real token writes its own request's block (request {int(req[t])}, {table_name}[{int(req[t])}, "
            f"{int(positions[t] // bs)}] = {int(blocks[t])}); any other slot overwrites another request's KV cache",
            key,
        )  # fmt: skip
    if dummy:
        return
    if seq_lens is not None:
        seq = seq_lens.astype(np.int64)
        cols = np.arange(table.shape[1])
        used = cols < -(-seq // bs)[:, None]  # [r, B]: the columns each request touches
        if window is not None:
            used &= cols >= (np.maximum(0, seq - lens.astype(np.int64) - window + 1) // bs)[:, None]
        null = np.argwhere(used & (table[: len(seq)] == 0))
        if null.size:
            i, j = (int(v) for v in null[0])
            verb = "writes this step's keys into" if j >= (int(seq[i]) - int(lens[i])) // bs else "reads"
            _fail(
                table_name, f"{i}, {j}", "a block of the request's own", 0,
                f"request {i} {verb} the null block 0, which padded rows and dummy runs share (capture writes it); "
                "an engine never hands block 0 to a live request", key,
            )  # fmt: skip
    null_tokens = np.flatnonzero(blocks == 0)
    if null_tokens.size:
        t = int(null_tokens[0])
        _fail(
            slot_name, t, f"outside block 0 (slots >= {bs})", int(slots[t]),
            f"request {int(req[t])} writes the null block 0, which padded rows and dummy runs share; "
            "an engine never hands block 0 to a live request", key,
        )  # fmt: skip
    order = np.argsort(slots, kind="stable")
    same = np.flatnonzero(slots[order[1:]] == slots[order[:-1]])
    if same.size:
        first, second = int(order[same[0]]), int(order[same[0] + 1])
        _fail(
            slot_name, second, f"a slot no other token writes (token {first} writes it)", int(slots[second]),
            f"two tokens of one step write one KV slot (requests {int(req[first])} and {int(req[second])} share "
            "a block): one overwrites the other's keys and values", key,
        )  # fmt: skip


def check_group_rows(
    inputs: ForwardInputs, level: str, lens: np.ndarray | None, *, dummy: bool, kv_writes: bool
) -> None:
    """Every extra KV-cache group's staged rows: the basic pad rule, then (`full`, `lens` given) the rest."""
    host, key, pad = inputs.host, inputs.key, inputs.limits.pad
    n, r = inputs.num_tokens, inputs.num_reqs
    for group in inputs.limits.kv_groups:
        rows = host.kv_groups[group.name]
        slot_name, table_name = f"kv_groups[{group.name!r}].slot_mapping", f"kv_groups[{group.name!r}].block_table"
        slots, table = rows.slot_mapping, rows.block_table
        bad = np.flatnonzero(slots[n:] != pad.slot)
        if bad.size:
            t = n + int(bad[0])
            _fail(slot_name, t, pad.slot, int(slots[t]), "a padded token must never write the KV cache", key)
        if level != "full" or lens is None:  # `lens` comes with `full`
            continue
        if table.size and (table.min() < 0 or table.max() >= group.num_blocks):
            i, j = np.argwhere((table < 0) | (table >= group.num_blocks))[0]
            why = f"block ids index the group's KV cache (num_blocks {group.num_blocks})"
            _fail(table_name, f"{i}, {j}", f"in [0, {group.num_blocks})", int(table[i, j]), why, key)
        bad_rows = np.argwhere(table[r:] != pad.block_id)
        if bad_rows.size:
            i, j = bad_rows[0]
            why = "padded requests point at the pad block (padding.block_id)"
            _fail(table_name, f"{r + i}, {j}", pad.block_id, int(table[r + i, j]), why, key)
        real = slots[:n]
        if not kv_writes:
            bad = np.flatnonzero(real != pad.slot)
            if bad.size:
                t = int(bad[0])
                _fail(slot_name, t, pad.slot, int(real[t]), "a verification batch writes no live KV slot", key)
            continue
        if n and (real.min() < 0 or real.max() >= group.num_slots):
            t = int(np.argmax((real < 0) | (real >= group.num_slots)))
            why = "a real token writes a real slot of the group's KV cache"
            _fail(slot_name, t, f"in [0, {group.num_slots})", int(real[t]), why, key)
        check_writes(
            real, host.positions[:n], table, lens[:r], group.block_size, key, dummy=dummy,
            names=(slot_name, table_name), seq_lens=host.seq_lens[:r], window=group.sliding_window,
        )  # fmt: skip


def _fail(field: str, index: Any, expected: Any, actual: Any, why: str, key: Any) -> None:
    raise InvariantViolation(field, index, expected, actual, why, key)
