"""`check_invariants`: prove the staged metadata right before a graph reads it.

Checks run on the host staging arrays (`ForwardInputs.host`), vectorized, before the
upload is consumed. Level `basic` is O(requests) plus the padded token tail, cheap enough
for every production step; `full` adds the O(tokens) checks on real rows.

| rule | level | why it matters |
|---|---|---|
| `query_start_loc[0] == 0` | basic | offsets are relative to the batch start |
| `query_start_loc` non-decreasing over all R+1 entries | basic | a drop is a negative query length (the founding bug) |
| `query_start_loc[num_reqs] == num_tokens`, `[R] <= T` | basic | real requests own exactly the real tokens |
| padded `query_start_loc` rows follow the pad rule | basic | a stale tail is the founding bug |
| `seq_lens >= 0`, real `seq_lens >= query_len`, padded per rule | basic | attention reads `seq_len` keys |
| padded `slot_mapping` rows are the pad slot (negative) | basic | a padded token never writes a live KV cache slot |
| no real token's slot in the null block 0 (`0 <= slot < block_size`; real steps) | basic | capture writes block 0 |
| uniform key: every real request has `T / R` tokens | basic | uniform kernels assume it |
| `num_tokens <= T`, `num_reqs <= R` | basic | real rows fit the key |
| real `slot_mapping` in `[0, num_slots)` | full | an out-of-range slot is an illegal memory access |
| real `positions == seq_len - query_len + offset` | full | rotary and cache slots come from them |
| padded `positions`, `input_ids` per rule; ids in vocab | full | embedding and rotary lookups stay in range |
| `block_table` in `[0, num_blocks)`; padded rows per rule | full | an out-of-range block is an illegal access |
| own block, no slot twice; real requests never read or write block 0 | full | `graphcap.checks.kv_writes` |
| every KV-cache group (`kv_cache.groups`): the same slot and table rules | basic, full | `graphcap.checks.kv_writes` |
| a `reqs+1` engine buffer: `[0] == 0`, non-decreasing, padded entries per its pad | basic | as `query_start_loc` |
| other engine buffers: padded rows hold their pad; each buffer's own `check` | full; basic | their own |

Address checks (a static input replaced after capture) live with the graphs (`backends`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from graphcap.checks.kv_writes import check_group_rows, check_writes
from graphcap.checks.plans import basic_holds, full_holds, qsl_tail
from graphcap.config.buffers import cumulative_tail, real_rows
from graphcap.errors import InvariantViolation

if TYPE_CHECKING:  # numpy alone at run time (`graphcap inspect` re-checks without torch)
    from graphcap.inputs import BufferSpec, ForwardInputs

__all__ = ["LEVELS", "InvariantViolation", "check_invariants"]

LEVELS = ("off", "basic", "full")


def check_invariants(
    inputs: ForwardInputs,
    level: Literal["off", "basic", "full"] = "basic",
    *,
    dummy: bool = False,
    kv_writes: bool = True,
) -> None:
    """Raise `InvariantViolation` for the first broken rule in `inputs` (see the module table).

    Reads only `inputs.host`; never touches the device, so it is safe while a previous
    graph still runs. `dummy`: the batch is one graphcap made for capture or verification
    (or a step given without a block table), whose requests share the null block by design;
    the `full` rules on KV writes that only real steps must keep (no null block, no slot
    written twice) are skipped for it. A violation means something other than staging wrote
    the rows: the caller of a `PersistentBuffers` makes it rewrite every padded row next
    (`forget_padding`), as `CaptureManager` does. `kv_writes=False`: a verification batch whose real tokens
    must write nothing (every slot the pad slot; `full` checks that instead of their blocks).
    Normally `CaptureManager` calls this on every step.
    """
    if level == "off":
        return
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}; got {level!r}")
    null_block = kv_writes and not dummy  # graphcap's own batches share the null block by design
    holds = basic_holds(inputs, null_block=null_block)  # the few-call proof (graphcap.checks.plans)
    if not holds:
        _check_basic(inputs, null_block)  # finds and names the first broken rule
    lens = None
    if level == "full" and not (holds and full_holds(inputs, kv_writes, dummy)):
        lens = _lengths(inputs.host.query_start_loc)
        _check_full(inputs, lens, kv_writes)
        if kv_writes:
            _check_kv_writes(inputs, lens, dummy)
    if inputs.limits.kv_groups:
        if level == "full" and lens is None:
            lens = _lengths(inputs.host.query_start_loc)
        check_group_rows(inputs, level, lens, dummy=dummy, kv_writes=kv_writes)
    if inputs.limits.extras:
        _check_extras(inputs, level)


def _check_extras(inputs: ForwardInputs, level: str) -> None:
    """Engine buffers: a cumulative (`reqs+1`) one's offsets (any level), padded rows hold their pad (`full`);
    each buffer's own check (any level)."""
    for spec in inputs.limits.extras:
        view = inputs.host.extras[spec.name]
        real = real_rows(spec, inputs.num_tokens, inputs.num_reqs)
        if spec.is_cumulative:
            _check_cumulative(inputs, spec, view, inputs.num_reqs, inputs.key)
        elif level == "full" and real is not None:
            tail = view[(slice(None),) * spec.row_dim + (slice(real, None),)]
            bad = np.argwhere(tail != spec.pad)
            if bad.size:
                index = [int(i) for i in bad[0]]
                index[spec.row_dim] += real
                actual = view[tuple(index)].item()
                _fail(spec.name, ", ".join(map(str, index)), spec.pad, actual, "padded rows hold the buffer's pad",
                      inputs.key)  # fmt: skip
        if spec.check is not None:
            try:
                spec.check(view, view.shape[spec.row_dim] if real is None else real)
            except Exception as exc:  # the engine's own check: any exception refuses the step
                raise InvariantViolation(
                    spec.name, None, "its check to pass", f"refused ({type(exc).__name__}: {exc})",
                    f"the buffer's check ({getattr(spec.check, '__name__', 'check')}) refused the staged rows",
                    inputs.key,
                ) from exc  # fmt: skip


def _check_cumulative(inputs: ForwardInputs, spec: BufferSpec, view: np.ndarray, r: int, key: Any) -> None:
    """A `reqs+1` buffer holds offsets as `query_start_loc` does: entry 0 is 0, no entry below the one before,
    entries past the `r` real requests' follow the pad rule. A few numpy calls when they hold."""
    R = len(view) - 1
    if r > R:
        return  # the counts do not fit the key: the built-in rules name that
    if _cumulative_holds(inputs, spec, view, r):
        return  # the per-step cost
    if view[0] != 0:
        _fail(spec.name, 0, 0, view[0].item(), "cumulative offsets start at 0", key)
    drops = np.flatnonzero(view[1 : r + 1] < view[:r])
    if drops.size:
        i = int(drops[0]) + 1
        _fail(spec.name, i, f">= {view[i - 1].item()}", view[i].item(),
              "cumulative offsets never decrease (a drop is a negative length)", key)  # fmt: skip
    tail = cumulative_tail(spec, int(view[r]), R - r)
    bad = np.flatnonzero(view[r + 1 :] != tail)
    if bad.size:
        i = r + 1 + int(bad[0])
        rule = f"adds {spec.pad} to the entry before" if spec.pad else "repeats the last real entry"
        _fail(spec.name, i, int(tail[bad[0]]), view[i].item(), f"each padded entry {rule} (BufferSpec pad)", key)


_less, _subtract = np.less, np.subtract


class _CumulativePlan:
    """What `_cumulative_holds` reads for one staged `reqs+1` view and real count: views, scratch, expected bytes."""

    __slots__ = ("view", "hi", "lo", "ok", "none", "tail", "last", "scratch", "steps")

    def __init__(self, spec: BufferSpec, view: np.ndarray, r: int) -> None:
        R = len(view) - 1
        self.view, self.hi, self.lo = view, view[1 : r + 1], view[:r]
        self.ok, self.none = np.empty(r, dtype=bool), bytes(r)
        self.tail, self.last = view[r + 1 :], view[r : r + 1]
        self.scratch = np.empty(R - r, dtype=view.dtype)
        self.steps = cumulative_tail(spec, 0, R - r).astype(view.dtype).tobytes()  # pad * (1, 2, ...)


def _cumulative_holds(inputs: ForwardInputs, spec: BufferSpec, view: np.ndarray, r: int) -> bool:
    """True only when every rule of `_check_cumulative` holds, in a few byte compares (the per-step cost).
    The plan lives with `inputs` (staging hands back the same object for the same key and counts)."""
    plans = inputs.cumulative_plan
    if plans is None:
        plans = inputs.cumulative_plan = {}
    plan = plans.get(spec.name)
    if plan is None or plan.view is not view or len(plan.ok) != r:
        plan = plans[spec.name] = _CumulativePlan(spec, view, r)
    if view[0] != 0 or _less(plan.hi, plan.lo, out=plan.ok).tobytes() != plan.none:
        return False
    return not plan.steps or _subtract(plan.tail, plan.last, out=plan.scratch).tobytes() == plan.steps


def _check_basic(inputs: ForwardInputs, null_block: bool = True) -> None:
    host, key, pad = inputs.host, inputs.key, inputs.limits.pad
    n, r = inputs.num_tokens, inputs.num_reqs
    T, R = len(host.input_ids), len(host.seq_lens)
    if n > T or n < 0:
        _fail("num_tokens", None, f"0..{T}", n, "the real tokens must fit the key", key)
    if r > R or r < 0:
        _fail("num_reqs", None, f"0..{R}", r, "the real requests must fit the key", key)
    qsl = host.query_start_loc
    if qsl[0] != 0:
        _fail("query_start_loc", 0, 0, int(qsl[0]), "offsets start at 0", key)
    lens = _lengths(qsl)
    # A drop among the real offsets here; one in the padded tail is named by the tail rule
    # below, at the entry that breaks the rule rather than the one after it.
    if lens[:r].min(initial=0) < 0:
        _fail_decrease(qsl, int(np.argmax(lens[:r] < 0)) + 1, key)
    if qsl[r] != n:
        _fail("query_start_loc", r, n, int(qsl[r]), f"the {r} real requests own exactly the {n} real tokens", key)
    if qsl[R] > T:
        _fail("query_start_loc", R, f"<= {T}", int(qsl[R]), "no offset may point past the padded tokens", key)
    expected_tail = qsl_tail(T, R, n, r, pad.query_len)
    bad = np.flatnonzero(qsl[r + 1 :] != expected_tail)
    if bad.size:
        i = r + 1 + int(bad[0])
        if qsl[i] < qsl[i - 1]:
            _fail_decrease(qsl, i, key)
        _fail(
            "query_start_loc",
            i,
            int(expected_tail[bad[0]]),
            int(qsl[i]),
            "padded rows follow the pad rule (padding.query_len)",
            key,
        )
    if key.uniform and r:
        q = T // R
        if lens[:r].min() != q or lens[:r].max() != q:
            i = int(np.argmax(lens[:r] != q))
            _fail(
                "query_start_loc",
                i + 1,
                int(qsl[i]) + q,
                int(qsl[i + 1]),
                f"every real request of a uniform key has {q} tokens",
                key,
            )
    seq = host.seq_lens
    short = seq[:r] < lens[:r]
    if short.any():
        i = int(np.argmax(short))
        _fail(
            "seq_lens", i, f">= {int(lens[i])}", int(seq[i]), "a request attends to at least its own query tokens", key
        )
    bad = np.flatnonzero(seq[r:] != pad.seq_len)
    if bad.size:
        i = r + int(bad[0])
        _fail("seq_lens", i, pad.seq_len, int(seq[i]), "padded requests follow the pad rule (padding.seq_len)", key)
    if r and seq[:r].min() < 0:
        i = int(np.argmax(seq[:r] < 0))
        _fail("seq_lens", i, ">= 0", int(seq[i]), "lengths are never negative", key)
    slots = host.slot_mapping
    bad = np.flatnonzero(slots[n:] != pad.slot)
    if bad.size:
        i = n + int(bad[0])
        _fail(
            "slot_mapping",
            i,
            pad.slot,
            int(slots[i]),
            "a padded token must never write the KV cache (PAD_SLOT_ID)",
            key,
        )
    bs = inputs.limits.block_size
    real = slots[:n]
    if null_block and n and real.dtype == np.int32 and (real.view(np.uint32) < bs).any():
        t = int(np.argmax(real.view(np.uint32) < bs))
        why = (
            "a real token's KV slot lies in block 0, graphcap's null block, which padded rows and capture write (a "
            "later capture() would overwrite this request's keys and values); the engine's block allocator must "
            "never hand out block 0"
        )
        _fail("slot_mapping", t, f"a slot outside block 0 (>= {bs})", int(real[t]), why, key)


def _check_full(inputs: ForwardInputs, lens: np.ndarray, kv_writes: bool = True) -> None:
    host, key, lim = inputs.host, inputs.key, inputs.limits
    pad = lim.pad
    n, r = inputs.num_tokens, inputs.num_reqs
    slots = host.slot_mapping[:n]
    num_slots = lim.num_slots
    if not kv_writes:
        bad = np.flatnonzero(slots != pad.slot)
        if bad.size:
            t = int(bad[0])
            _fail("slot_mapping", t, pad.slot, int(slots[t]), "a verification batch writes no live KV slot", key)
    elif n and (slots.min() < 0 or (num_slots is not None and slots.max() >= num_slots)):
        t = int(np.argmax((slots < 0) | (slots >= (num_slots or np.iinfo(np.int32).max))))
        _fail("slot_mapping", t, f"in [0, {num_slots})", int(slots[t]), "a real token writes a real KV-cache slot", key)
    starts = host.query_start_loc[:r]
    context = host.seq_lens[:r] - lens[:r]
    expected = np.arange(n) + np.repeat(context - starts, lens[:r])
    bad = np.flatnonzero(host.positions[:n] != expected)
    if bad.size:
        t = int(bad[0])
        _fail(
            "positions",
            t,
            int(expected[t]),
            int(host.positions[t]),
            "positions are seq_len - query_len + offset within the request",
            key,
        )
    for name, value in (("positions", pad.position), ("input_ids", pad.token_id)):
        tail = getattr(host, name)[n:]
        bad = np.flatnonzero(tail != value)
        if bad.size:
            t = n + int(bad[0])
            _fail(
                name,
                t,
                value,
                int(tail[bad[0]]),
                f"padded tokens follow the pad rule (padding.{'position' if name == 'positions' else 'token_id'})",
                key,
            )
    ids = host.input_ids[:n]
    if n and (ids.min() < 0 or (lim.vocab_size is not None and ids.max() >= lim.vocab_size)):
        t = int(np.argmax((ids < 0) | (ids >= (lim.vocab_size or np.iinfo(np.int32).max))))
        _fail("input_ids", t, f"in [0, {lim.vocab_size})", int(ids[t]), "token ids index the embedding", key)
    table = host.block_table
    if table.size and (table.min() < 0 or (lim.num_blocks is not None and table.max() >= lim.num_blocks)):
        i, j = np.argwhere((table < 0) | (table >= (lim.num_blocks or np.iinfo(np.int32).max)))[0]
        _fail(
            "block_table",
            f"{i}, {j}",
            f"in [0, {lim.num_blocks})",
            int(table[i, j]),
            "block ids index the KV cache",
            key,
        )
    bad_rows = np.argwhere(table[r:] != pad.block_id)
    if bad_rows.size:
        i, j = bad_rows[0]
        _fail(
            "block_table",
            f"{r + i}, {j}",
            pad.block_id,
            int(table[r + i, j]),
            "padded requests point at the pad block (padding.block_id)",
            key,
        )


def _check_kv_writes(inputs: ForwardInputs, lens: np.ndarray, dummy: bool) -> None:
    """Where real tokens write the KV cache: within max_model_len, then the rules of `graphcap.checks.kv_writes`."""
    host, key, lim = inputs.host, inputs.key, inputs.limits
    n, r = inputs.num_tokens, inputs.num_reqs
    if not n:
        return
    if lim.max_model_len is not None:
        seq = host.seq_lens[:r]
        if r and seq.max() > lim.max_model_len:
            i = int(np.argmax(seq > lim.max_model_len))
            _fail("seq_lens", i, f"<= {lim.max_model_len}", int(seq[i]), "a request fits kv_cache.max_model_len", key)
        positions = host.positions[:n]
        if positions.max() >= lim.max_model_len:
            t = int(np.argmax(positions >= lim.max_model_len))
            why = "rotary tables end at max_model_len"
            _fail("positions", t, f"< {lim.max_model_len}", int(positions[t]), why, key)
    check_writes(
        host.slot_mapping[:n], host.positions[:n], host.block_table, lens[:r], lim.block_size, key,
        dummy=dummy, seq_lens=host.seq_lens[:r],
    )  # fmt: skip


def _lengths(qsl: np.ndarray) -> np.ndarray:
    # int64: in int32 a drop of more than 2**31 (garbage) would wrap to a positive length.
    return np.diff(qsl.astype(np.int64))


def _fail_decrease(qsl: np.ndarray, i: int, key: Any) -> None:
    _fail(
        "query_start_loc", i, f">= {int(qsl[i - 1])}", int(qsl[i]),
        "offsets must never decrease; a padded tail must repeat the last real offset, "
        "or query lengths go negative (repeat_interleave asserts 'repeat >= 0')", key,
    )  # fmt: skip


def _fail(field: str, index: Any, expected: Any, actual: Any, why: str, key: Any) -> None:
    raise InvariantViolation(field, index, expected, actual, why, key)
