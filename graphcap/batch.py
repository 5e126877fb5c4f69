"""`StepBatch` (one scheduler step, host side), and the dummy batch graphcap captures a key with.

A `StepBatch` is what a scheduler hands the model runner: per-request query lengths (the
tokens computed this step) and total sequence lengths, optionally the token ids and the
block table (an array, or the rows of a persistent `BlockTable`). Building one costs a few
microseconds whatever its size: the value checks run in `PersistentBuffers.stage`, folded
into the pass that stages the values.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from graphcap._fastnp import ONES_BYTES, amax, amin, ones, unsigned_max
from graphcap.block_table import BlockTable
from graphcap.errors import BatchError
from graphcap.fields import INT32_MAX
from graphcap.keys import GraphKey

__all__ = ["IDLE", "StepBatch", "check_block_ids", "check_seq_lens", "check_token_ids", "dummy_batch", "step_or_idle"]

_NO_EXTRAS: Mapping[str, np.ndarray] = MappingProxyType({})
_NO_AXES: Mapping[str, int] = MappingProxyType({})
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


class StepBatch:
    """One step as the scheduler sees it: request lengths, token ids and where the blocks are.

    `query_lens[i]`: tokens of request i computed this step (>= 1).
    `seq_lens[i]`: total length of request i *including* this step's tokens (>= query_lens[i]).
    `input_ids`: `sum(query_lens)` token ids in request order, or None (all token 0).
    `block_table`: where each request's KV-cache blocks are, one of
      - a 2-D array, `block_table[i, j]` the j-th block of request i, with at least
        `ceil(seq_lens[i] / block_size)` columns (a fresh table: copied and checked every step);
      - the manager's persistent `BlockTable` (`CaptureManager.block_table`): request i reads
        row i, which the engine keeps with `set_row`/`append`/`move`/`clear` (checked at write;
        the step neither copies nor scans it);
      - None: every request uses the null block 0 (dummy runs).
    `extras`: real rows of the engine's own buffers (`BufferSpec`), by name.
    `kv_groups`: each extra KV-cache group's table (`kv_cache.groups`) by name, given as
      `block_table` is (an array, or the group's persistent table `manager.kv_group_tables[name]`).
    `axes`: the step's value of each key axis (`capture.axes`) by name, integers >= 0 (a missing
      axis is its smallest captured value); dispatch pads each to a captured value and refuses a
      name the config does not plan.

    Construction checks what dispatch needs: shapes, lengths and `query_lens` (kept as a
    read-only copy, or a shared constant for a decode step, so `num_tokens` and uniformity
    cannot change after dispatch). The values of `seq_lens`, `input_ids` and `block_table`
    are checked by `PersistentBuffers.stage` in the same pass that stages them, before it
    writes anything: what was checked is what is staged. Native int32/int64 arrays are
    referenced, not copied: an engine that changes one before staging stages (or is refused
    for) the changed values. Anything else (lists, other dtypes, byte orders) is converted
    into a read-only array the batch owns, and its values are checked here as well.
    Refusals raise `BatchError` (a `ValueError`) naming the field, the index and the value.
    """

    __slots__ = (
        "query_lens",
        "seq_lens",
        "input_ids",
        "block_table",
        "num_reqs",
        "num_tokens",
        "min_query_len",
        "max_query_len",
        "extras",
        "kv_groups",
        "axes",
    )

    query_lens: np.ndarray
    seq_lens: np.ndarray
    input_ids: np.ndarray | None
    block_table: BlockTable | np.ndarray | None
    num_reqs: int
    num_tokens: int
    min_query_len: int
    max_query_len: int
    extras: Mapping[str, np.ndarray]
    kv_groups: Mapping[str, BlockTable | np.ndarray]
    axes: Mapping[str, int]

    def __init__(
        self,
        query_lens: npt.ArrayLike,
        seq_lens: npt.ArrayLike,
        input_ids: npt.ArrayLike | None = None,
        block_table: BlockTable | npt.ArrayLike | None = None,
        *,
        extras: Mapping[str, npt.ArrayLike] | None = None,
        kv_groups: Mapping[str, BlockTable | npt.ArrayLike] | None = None,
        axes: Mapping[str, int] | None = None,
    ) -> None:
        # Hot path (every step): a decode step's int32 query_lens is one memcmp against a shared
        # row of ones; the other arrays are taken by reference (no copy, no scan: stage does both).
        q0 = query_lens
        if (
            type(q0) is np.ndarray
            and q0.dtype is _I32
            and q0.ndim == 1
            and q0.size
            and ONES_BYTES.startswith(q0.tobytes())
        ):
            num_reqs = num_tokens = len(q0)
            q_min = q_max = 1
            q = ones(num_reqs)
        else:
            q, q_min, q_max, num_tokens = _query_lens(q0)
            num_reqs = len(q)
        s0 = seq_lens
        if type(s0) is np.ndarray and s0.ndim == 1 and (s0.dtype is _I32 or s0.dtype is _I64):
            s = s0
        else:
            s = _converted(s0, "seq_lens", 1)
            if len(s) == num_reqs:
                check_seq_lens(q, s)
                s = _owned_int32(s)
        if len(s) != num_reqs:
            raise BatchError(
                f"seq_lens has {len(s)} entries but query_lens has {num_reqs}; give one entry per request in both"
            )
        ids0 = input_ids
        ids: np.ndarray | None = None
        if ids0 is not None:
            if type(ids0) is np.ndarray and ids0.ndim == 1 and (ids0.dtype is _I32 or ids0.dtype is _I64):
                ids = ids0
            else:
                ids = _converted(ids0, "input_ids", 1)
                check_token_ids(ids)
                ids = _owned_int32(ids)
            if len(ids) != num_tokens:
                raise BatchError(
                    f"input_ids has {len(ids)} entries but query_lens sum to {num_tokens}; "
                    "give one token id per computed token, in request order"
                )
        bt0 = block_table
        bt: BlockTable | np.ndarray | None = None
        if bt0 is not None:
            if isinstance(bt0, BlockTable):
                bt = bt0
            else:
                if type(bt0) is np.ndarray and bt0.ndim == 2 and (bt0.dtype is _I32 or bt0.dtype is _I64):
                    bt = bt0
                else:
                    bt = _converted(bt0, "block_table", 2)
                    check_block_ids(bt)
                    bt = _owned_int32(bt)
                if bt.shape[0] != num_reqs:
                    raise BatchError(
                        f"block_table has {bt.shape[0]} rows but the batch has {num_reqs} requests; "
                        "give one row per request"
                    )
        self.query_lens = q
        self.seq_lens = s
        self.input_ids = ids
        self.block_table = bt
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        self.min_query_len = q_min
        self.max_query_len = q_max
        self.extras = _NO_EXTRAS if not extras else _owned_extras(extras)
        self.kv_groups = _NO_EXTRAS if not kv_groups else _owned_group_tables(kv_groups, num_reqs)
        self.axes = _NO_AXES if not axes else _owned_axes(axes)

    def is_uniform(self, query_len: int) -> bool:
        """True when every request has exactly `query_len` tokens (an empty batch is uniform)."""
        return self.num_reqs == 0 or self.min_query_len == self.max_query_len == query_len

    @property
    def max_seq_len(self) -> int:
        """The longest `seq_lens` entry (0 without requests); computed on each call."""
        return int(amax(self.seq_lens)) if self.num_reqs else 0

    @property
    def max_token_id(self) -> int:
        """The largest token id, -1 without ids; computed on each call."""
        ids = self.input_ids
        return int(amax(ids)) if ids is not None and len(ids) else -1

    @property
    def max_block_id(self) -> int:
        """The largest block id of a fresh table, -1 without one; computed on each call."""
        bt = self.block_table
        return int(amax(bt.ravel())) if isinstance(bt, np.ndarray) and bt.size else -1

    def __repr__(self) -> str:
        axes = f", axes={dict(self.axes)}" if self.axes else ""
        return (
            f"StepBatch(num_reqs={self.num_reqs}, num_tokens={self.num_tokens}, "
            f"query_lens={_short(self.query_lens)}, seq_lens={_short(self.seq_lens)}{axes})"
        )


def dummy_batch(key: GraphKey, *, max_model_len: int | None = None) -> StepBatch:
    """A batch that fills `key` the way capture needs, with the null block table.

    Uniform key: `key.num_reqs` requests of `T / R` tokens each. Mixed key: all `T` tokens
    spread over fewer requests than `R` (when `R > 1`), so the padded requests of the
    founding bug exist during capture. `max_model_len` caps each request's length. The batch
    states the key's axis values (`key.axes`).
    """
    T, R = key.num_tokens, key.num_reqs
    if R is None:
        raise BatchError(
            f"dummy_batch({key}): a piecewise key has no request count to fill; "
            "give the key its capture shape (KeyRegistry.capture_shape) instead"
        )
    if key.uniform:
        if T % R:
            raise BatchError(f"uniform {key} must have num_tokens divisible by num_reqs")
        q = np.full(R, T // R, dtype=np.int32)
    else:
        limit = max_model_len or T
        num_real = max(1, R // 2, -(-T // limit))
        if num_real > R or num_real > T:
            raise BatchError(f"{key} cannot hold {T} tokens in requests of at most {limit}")
        q = np.full(num_real, T // num_real, dtype=np.int32)
        q[: T % num_real] += 1
    return StepBatch(q, q.copy(), axes=dict(key.axes))


def step_or_idle(batch: StepBatch | None) -> StepBatch:
    """`batch`, or for None (an idle data-parallel rank) an empty step; `TypeError` for anything else."""
    if batch is None:
        return IDLE
    if not isinstance(batch, StepBatch):
        raise TypeError(f"expected a StepBatch (or None for an idle rank); got {type(batch).__name__}")
    return batch


def check_seq_lens(q: np.ndarray, s: np.ndarray) -> None:
    """`seq_lens` within int32 and `>= query_lens` (both 1-D, same length, `q >= 1`)."""
    if not len(s):
        return
    if unsigned_max(s) > INT32_MAX and amax(s) > INT32_MAX:  # a negative is named against its query_len
        i = int(np.argmax(s))
        raise BatchError(f"seq_lens[{i}] is {int(s[i])}, above the int32 range of the buffers")
    below = s < q
    if not below.any():
        return
    i = int(np.argmax(below))
    raise BatchError(
        f"seq_lens[{i}] is {int(s[i])} but query_lens[{i}] is {int(q[i])}; seq_lens count every token "
        "of the request including this step's, so seq_lens >= query_lens"
    )


def check_token_ids(ids: np.ndarray) -> None:
    """Token ids within int32 and `>= 0`."""
    if unsigned_max(ids) > INT32_MAX:
        _check_int32(ids, "input_ids")
        t = int(np.argmax(ids < 0))
        raise BatchError(f"input_ids[{t}] is {int(ids[t])}; token ids are >= 0")


def check_block_ids(table: np.ndarray, name: str = "block_table") -> None:
    """Block ids within int32 and `>= 0`."""
    if unsigned_max(table) > INT32_MAX:
        _check_int32(table, name)
        i, j = np.argwhere(table < 0)[0]
        raise BatchError(f"{name}[{i}, {j}] is {int(table[i, j])}; block ids are >= 0")


def _check_int32(array: np.ndarray, name: str) -> None:
    top = int(amax(array.ravel()))
    if top > INT32_MAX:
        raise BatchError(f"{name} holds {top}, above the int32 range of the buffers")


def _query_lens(values: npt.ArrayLike) -> tuple[np.ndarray, int, int, int]:
    """`(query_lens as a read-only int32 array the batch owns, min, max, sum)`, each checked."""
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype is _I32 and len(values):
        q = values.copy()  # ours: the caller may reuse its array; num_tokens must stay true
        q_min, q_max = int(amin(q)), int(amax(q))
        if q_min >= 1:
            q.flags.writeable = False
            return q, q_min, q_max, int(np.add.reduce(q, dtype=_I64))
    else:
        q = _converted(values, "query_lens", 1)
        if not len(q):
            return _owned_int32(q), 0, 0, 0
        q_min, q_max = int(amin(q)), int(amax(q))
    if q_min < 1:
        i = int(np.argmax(q < 1))
        raise BatchError(
            f"query_lens[{i}] is {int(q[i])}; every scheduled request computes at "
            "least one token: drop requests with nothing to compute from the step"
        )
    if q_max > INT32_MAX:
        raise BatchError(f"query_lens holds {q_max}, above the int32 range of the buffers")
    q = _owned_int32(q)
    return q, q_min, q_max, int(np.add.reduce(q, dtype=_I64))


def _converted(values: npt.ArrayLike, name: str, ndim: int) -> np.ndarray:
    """`values` as a new native integer numpy array (int64 or int32), shape-checked; values not yet range-checked."""
    array: np.ndarray
    if isinstance(values, np.ndarray):
        array = values.copy()  # ours: the caller may reuse its own array for the next step
    else:
        try:
            array = np.asarray(values)
        except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, odd objects
            ragged = _ragged(values, name, ndim)
            raise BatchError(ragged or f"{name} must be a {ndim}-D array of integers; {exc}") from None
    if array.ndim != ndim:
        if not (array.size == 0 and ndim == 2):
            raise BatchError(f"{name} must be {ndim}-D; got shape {tuple(array.shape)}")
        array = array.reshape(0, 0)
    if array.dtype.kind not in "iu":
        if array.size != 0:
            raise BatchError(f"{name} must hold integers; got dtype {array.dtype}")
        return array.astype(np.int64)  # np.asarray([]) is float64
    if array.dtype.kind == "u" and array.itemsize >= 4:
        # uint32/uint64 hold values int32 cannot; with int32 arithmetic uint64 even promotes to
        # float64. Refuse values above int32 here and keep the rest exactly as int64.
        if array.size and int(amax(array.ravel())) > INT32_MAX:
            raise BatchError(f"{name} holds {int(amax(array.ravel()))}, above the int32 range of the buffers")
        return array.astype(np.int64)
    # int8/int16 widen (read as unsigned, -1 would pass as 255); byte-swapped become native.
    return array.astype(np.int64 if array.itemsize == 8 else np.int32)


def _ragged(values: Any, name: str, ndim: int) -> str | None:
    """What is wrong with `values` when it is a list of rows of different lengths (a 2-D field), or None."""
    if ndim != 2:
        return None
    try:
        lengths = [len(row) for row in values]
    except TypeError:  # not rows: numpy's own message says what it is
        return None
    if len(set(lengths)) < 2:
        return None
    widest = max(lengths)
    short = next(i for i, n in enumerate(lengths) if n != lengths[0])
    persistent = "manager.block_table" if name == "block_table" else f"manager.kv_group_tables[{name[10:-1]}]"
    return (
        f"{name} rows have different lengths (row 0: {lengths[0]} blocks, row {short}: {lengths[short]}); it is "
        f"one rectangular array: pad every row to the longest ({widest}) with 0, the null block (a request reads "
        f"only the blocks its seq_len needs), or name the persistent table ({persistent})"
    )


def _owned_int32(array: np.ndarray) -> np.ndarray:
    """A read-only int32 array of `array`'s values (already checked to fit)."""
    out = array.astype(np.int32, copy=array.dtype != _I32)
    out.flags.writeable = False
    return out


def _owned_extras(extras: Any) -> Mapping[str, np.ndarray]:
    if not isinstance(extras, Mapping):
        raise BatchError(f"extras must map buffer names to arrays; got {type(extras).__name__}")
    out = {}
    for name, values in extras.items():
        try:
            array = np.array(values, copy=True)
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchError(f"extras[{name!r}] must be an array of numbers; {exc}") from None
        if array.dtype.kind not in "biuf":
            raise BatchError(f"extras[{name!r}] must hold numbers or booleans; got dtype {array.dtype}")
        array.flags.writeable = False
        out[name] = array
    return MappingProxyType(out)


def _owned_axes(axes: Any) -> Mapping[str, int]:
    """The step's axis values, checked (names are strings, values integers in [0, INT32_MAX]) and read-only."""
    if not isinstance(axes, Mapping):
        raise BatchError(f"axes must map axis names (capture.axes) to integers; got {type(axes).__name__}")
    out = {}
    for name, value in axes.items():
        if not isinstance(name, str):
            raise BatchError(f"axes names must be strings (the names of capture.axes); got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise BatchError(f"axes[{name!r}] must be an integer; got {value!r} ({type(value).__name__})")
        if not 0 <= value <= INT32_MAX:
            raise BatchError(f"axes[{name!r}] is {int(value)}; axis values lie in [0, {INT32_MAX}]")
        out[name] = int(value)
    return MappingProxyType(out)


def _owned_group_tables(tables: Any, num_reqs: int) -> Mapping[str, Any]:
    """Each group's table as `block_table` is taken: a `BlockTable` as is, an array checked and owned."""
    if not isinstance(tables, Mapping):
        raise BatchError(f"kv_groups must map group names to block tables; got {type(tables).__name__}")
    out = {}
    for name, table in tables.items():
        if table is not None and not isinstance(table, BlockTable):
            what = f"kv_groups[{name!r}]"
            table = _converted(table, what, 2)
            check_block_ids(table, what)
            table = _owned_int32(table)
            if table.shape[0] != num_reqs:
                raise BatchError(
                    f"kv_groups[{name!r}] has {table.shape[0]} rows but the batch has {num_reqs} requests; "
                    "give one row per request"
                )
        out[name] = table
    return MappingProxyType(out)


def _short(array: np.ndarray) -> str:
    items = array.tolist()
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"


IDLE = StepBatch([], [])
"""The step of an idle data-parallel rank (no tokens, no requests): one object, so `batch is IDLE` tells it."""
