"""`KeyRegistry`: the one place keys are made, and dispatch.

Keys come from the config once (mode, sizes, uniform query length, request limit). The
capture loop marks each key captured or skipped; `dispatch` maps a step's counts to a
captured key in O(1) (one padding-table index per kind) and says how the step runs (`Mode`):
a full graph, a piecewise graph, or eagerly with an explicit reason. As in vLLM's dispatcher,
the mode travels beside the key and graphs trust the key they are given, so every key used
anywhere (planning, dispatch, data-parallel agreement, capture batches, eager steps) comes
from this module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from graphcap.errors import BatchError
from graphcap.keys.axes import KeyAxes
from graphcap.keys.key import Dispatch, GraphKey, Mode, planned_order
from graphcap.sizing.sizes import CaptureSizes, uniform_sizes

__all__ = ["MIXED_ROWS_FLOOR", "MIXED_ROWS_STEP", "KeyRegistry", "mixed_request_rows"]


MIXED_ROWS_STEP = 4
"""Each smaller request-row count of a mixed size is this many times fewer rows."""
MIXED_ROWS_FLOOR = 64
"""No mixed key gets fewer request rows than this by the ladder (below it padded rows cost little)."""


def mixed_request_rows(size: int, max_num_seqs: int, max_model_len: int | None = None) -> tuple[int, ...]:
    """Request-row counts of the mixed keys of `size` tokens, ascending.

    `min(size, max_num_seqs)` (any step of `size` tokens fits), then `MIXED_ROWS_STEP` times
    fewer (rounded down to a multiple of 8) while that leaves at least `MIXED_ROWS_FLOOR` rows
    and `ceil(size / max_model_len)` (the requests `size` tokens need at least). A
    mixed step of 256 requests and 2304 tokens then pads to 256 rows, not 1024: rows that a
    step does not use still cost the upload, the attention kernels' grid and the host-side
    planning of every padded request.
    """
    capacity = min(size, max_num_seqs)
    least = 1 if not max_model_len else -(-size // max_model_len)
    rows = [capacity]
    while True:
        smaller = rows[-1] // MIXED_ROWS_STEP // 8 * 8
        if smaller < MIXED_ROWS_FLOOR or smaller < least or smaller >= rows[-1]:
            break
        rows.append(smaller)
    return tuple(reversed(rows))


class KeyRegistry:
    """Keys planned from a config, their capture state, and the dispatch table.

    Mixed keys (mode `full`): per size, one per `mixed_request_rows(size, max_num_seqs,
    max_model_len)` row count, `min(size, max_num_seqs)` and, for large sizes, a few with
    fewer request rows; a mixed step replays the one with the fewest rows that hold it.
    Uniform keys: `num_reqs = size / q` at every size `sizes.uniform_sizes` gives (modes
    `full`, `full_decode_only` and `full_and_piecewise`): sizes of whole requests within
    `max_num_seqs`, plus `max_num_seqs * q` itself. Piecewise keys (modes `piecewise` and
    `full_and_piecewise`): one per size, `num_reqs` None; every step up to the largest size
    that has no uniform key replays one. Mode `none` plans nothing. Does not stage or run anything.

    Key axes (`axes`, from `capture.axes`: name -> ascending values): every token key is planned at
    every combination of axis values, or at those `combinations` lists (`capture.axis_combinations`).
    A step's value of each axis pads to the smallest captured value at or above it (one padding table
    per axis, built here); the padded combination maps (one dict lookup) to the listed combination that
    holds it with the fewest padded slots, then the token tables pick the key as without axes. A value
    above an axis's largest runs eagerly (reason `above_max_axis.NAME`), as does a step no listed
    combination holds (`no_axis_combination`).
    """

    def __init__(
        self,
        sizes: CaptureSizes,
        mode: str,
        uniform_query_len: int,
        max_num_seqs: int,
        max_model_len: int | None = None,
        max_padding_factor: float | None = None,
        axes: Mapping[str, tuple[int, ...]] | None = None,
        combinations: Iterable[Mapping[str, int]] = (),
    ) -> None:
        self.sizes = sizes
        self.mode = mode
        self.uniform_query_len = q = uniform_query_len
        self.max_num_seqs = max_num_seqs
        self._key_axes = key_axes = KeyAxes(axes, combinations)
        self.axes: dict[str, tuple[int, ...]] = key_axes.values
        """Each key axis's captured values, ascending (empty: no axes)."""
        # The hot path's reads, one attribute each (see `KeyAxes`)
        self._axis_names, self._axis_pad, self._axis_index = key_axes.names, key_axes.tables, key_axes.index
        self._axis_floors = key_axes.floors  # captured values: padded already
        planned: list[GraphKey] = []
        padded = sizes.padded_counts()  # `sizes.pad(n)` by index
        # Index by token count: the dispatch hot path is one list index per kind (mixed: the
        # size's keys by ascending request rows).
        self._uniform: list[GraphKey | None] = [None] * (sizes.max_size + 1)
        self._mixed: list[tuple[GraphKey, ...]] = [()] * (sizes.max_size + 1)
        self._piecewise: list[GraphKey | None] = [None] * (sizes.max_size + 1)
        if mode != "none":
            uniform = [GraphKey(size, size // q, True) for size in uniform_sizes(sizes, q, max_num_seqs)]
            mixed = (
                [
                    GraphKey(size, rows, False)
                    for size in sizes
                    for rows in mixed_request_rows(size, max_num_seqs, max_model_len)
                ]
                if mode == "full"
                else []
            )
            if mode == "piecewise":
                uniform = []
            pieces = [GraphKey(size, None, False) for size in sizes] if "piecewise" in mode else []
            planned = uniform + mixed + pieces
            if pieces:
                by_size_pieces = {key.num_tokens: key for key in pieces}
                self._piecewise = [by_size_pieces[padded[n]] for n in range(sizes.max_size + 1)]
            # Each token count maps to the smallest key that holds it. A uniform key is used
            # only where it pads no further than the schedule does (its size <= pad(n)).
            fill = iter(uniform)
            key = next(fill, None)
            for n in range(sizes.max_size + 1):
                while key is not None and key.num_tokens < n:
                    key = next(fill, None)
                if key is not None and key.num_tokens <= padded[n]:
                    self._uniform[n] = key
            if mixed:
                by_size: dict[int, tuple[GraphKey, ...]] = {}
                for key in mixed:
                    by_size[key.num_tokens] = (*by_size.get(key.num_tokens, ()), key)
                self._mixed = [by_size[padded[n]] for n in range(sizes.max_size + 1)]
        # The padding factor folded into the tables once: a uniform key past it is dropped from its
        # counts, and `_over_padding[n]` marks the counts whose schedule size is past it.
        self.max_padding_factor = max_padding_factor
        self._over_padding = [False] * (sizes.max_size + 1)
        self._uniform_over = [False] * (sizes.max_size + 1)  # a uniform key dropped by the factor
        if max_padding_factor is not None:
            for n in range(1, sizes.max_size + 1):
                limit = max_padding_factor * n
                self._over_padding[n] = padded[n] > limit
                key = self._uniform[n]
                if key is not None and key.num_tokens > limit:
                    self._uniform[n] = None
                    self._uniform_over[n] = True
        at = {combo: {key: key._replace(axes=combo) for key in planned} for combo in key_axes.planned}
        # Every combination of padded axis values -> each token key -> its key at the combination that holds it.
        self._variants: dict[tuple[int, ...], dict[GraphKey, GraphKey]] = {
            values: at[combo] for values, combo in key_axes.holder.items()
        }
        planned = [key._replace(axes=combo) for key in planned for combo in key_axes.planned]
        self.planned: tuple[GraphKey, ...] = tuple(sorted(planned, key=planned_order))
        self._order = tuple(
            sorted(self.planned, key=lambda k: (-k.num_tokens, tuple(-v for _, v in k.axes), *planned_order(k)[1:]))
        )
        self.captured: set[GraphKey] = set()
        self.skipped: dict[GraphKey, str] = {}
        self.declined: dict[GraphKey, str] = {}
        """Of `skipped`, keys left uncaptured by choice: the eager reason (`over_budget`, `no_speedup`)."""
        self.uncaptured_reason = "not_captured"
        """Why a planned key without a graph runs eagerly: `not_captured`, `pending`, or what freed its graph."""
        self.demand: Counter = Counter()
        """Eager steps per planned key that was not captured (the traffic lazy capture orders keys by)."""

    @classmethod
    def from_config(cls, config) -> KeyRegistry:
        registry = cls(
            config.capture_sizes,
            config.capture.mode,
            config.capture.uniform_query_len,
            config.batching.max_num_seqs,
            config.kv_cache.max_model_len,
            config.capture.max_padding_factor,
            axes=config.capture.axes,
            combinations=config.capture.axis_combinations,
        )
        if config.capture.strategy == "lazy":
            registry.uncaptured_reason = "pending"
        return registry

    def capture_order(self) -> list[GraphKey]:
        """Largest first (smaller graphs then reuse the pool): by tokens, then by axis values (larger
        first); uniform before mixed; more rows first."""
        return list(self._order)

    def mode_of(self, key: GraphKey) -> Mode:
        """How a planned key's graph runs: `PIECEWISE` for a key of any request count, else `FULL`."""
        return Mode.PIECEWISE if key.num_reqs is None else Mode.FULL

    def capture_shape(self, key: GraphKey) -> GraphKey:
        """The padded counts of the batches that capture and verify `key` (`dummy_batch`, `probe_batch`).

        The key itself, or for a piecewise key its tokens over as many requests as a step of
        that size can have (`min(T, max_num_seqs)`), so its capture batches have padded requests.
        """
        if key.num_reqs is not None:
            return key
        return GraphKey(key.num_tokens, min(key.num_tokens, self.max_num_seqs), False, key.axes)

    def mark_captured(self, key: GraphKey) -> None:
        self._check_planned(key)
        self.skipped.pop(key, None)
        self.captured.add(key)

    def mark_skipped(self, key: GraphKey, reason: str, eager_reason: str = "skipped") -> None:
        """`key` runs eagerly from now on (`reason`: the report's words; `eager_reason`: its `stats.eager` key)."""
        self._check_planned(key)
        self.captured.discard(key)
        self.skipped[key] = reason
        if eager_reason != "skipped":
            self.declined[key] = eager_reason

    def pending(self) -> list[GraphKey]:
        """Planned keys neither captured nor skipped, in `capture_order`."""
        return [key for key in self._order if key not in self.captured and key not in self.skipped]

    @property
    def num_pending(self) -> int:
        """How many keys `pending()` holds, in O(1): `captured` and `skipped` are disjoint sets of planned keys."""
        return len(self.planned) - len(self.captured) - len(self.skipped)

    def reset(self, reason: str = "not_captured") -> None:
        """Forget capture state (keys stay planned); `reason`: why steps run eagerly until a capture
        (`released`, `kv_resized`)."""
        self.captured.clear()
        self.skipped.clear()
        self.declined.clear()
        self.uncaptured_reason = reason

    def axis_values(self, axes: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
        """A step's value of every key axis, `(name, value)` in the config's order (a missing axis: its smallest
        value); `BatchError` naming an axis that `capture.axes` does not plan, and the axes it plans."""
        return self._key_axes.of_step(axes)

    def dispatch(
        self,
        num_tokens: int,
        num_reqs: int,
        uniform: bool,
        axes: Mapping[str, int] | None = None,
        *,
        count: bool = True,
    ) -> Dispatch:
        """How a step of these counts runs: its captured key and mode, or eagerly with a reason.

        `uniform`: every request of the step has exactly `uniform_query_len` tokens (an empty
        step is uniform). A uniform step prefers its uniform key and falls back to the mixed
        (or piecewise) key of its size; a key that was skipped or not captured yet is never
        returned. `axes`: the step's key-axis values (`StepBatch.axes`), each padded to the
        smallest captured value at or above it; `BatchError` for an axis `capture.axes` does not plan, and for
        more requests than `batching.max_num_seqs` (staging refuses such a step too: no key holds it).
        `count`: a key with no graph yet counts the step in `demand` (False: a look that is not the
        step's key, such as a data-parallel rank's own before the agreement, or
        `CaptureManager.dispatch()`, a query). A step its graph would pad past `max_padding_factor`
        times its tokens runs eagerly (`over_padding`; a uniform step whose uniform key is within the
        factor but not captured: that key's reason).
        """
        if self._axis_names or axes:
            return self._dispatch_axes(num_tokens, num_reqs, uniform, axes, count)
        if self.mode == "none":
            return self._eager(num_tokens, num_reqs, "mode_none")
        if num_tokens > self.sizes.max_size:
            return self._eager(num_tokens, num_reqs, "above_max_size")
        return self._dispatch_tokens(num_tokens, num_reqs, uniform, None, None, count)

    def _dispatch_axes(self, num_tokens: int, num_reqs: int, uniform: bool, axes: Any, count: bool) -> Dispatch:
        """`dispatch` with key axes: pad each axis (one table index), then the token keys at those values."""
        if self.mode == "none":
            return self._eager(num_tokens, num_reqs, "mode_none", axes)
        if num_tokens > self.sizes.max_size:
            return self._eager(num_tokens, num_reqs, "above_max_size", axes)
        if not axes:
            at = self._variants.get(self._axis_floors)
            if at is None:
                return self._eager(num_tokens, num_reqs, "no_axis_combination", axes)
            return self._dispatch_tokens(num_tokens, num_reqs, uniform, at, axes, count)
        padded, index, tables = list(self._axis_floors), self._axis_index, self._axis_pad
        for name, value in axes.items():
            i = index.get(name)
            if i is None:
                self._key_axes.refuse_unplanned(name)
            table = tables[i]
            if not 0 <= value < len(table):
                if value < 0:
                    raise BatchError(f"axes[{name!r}] is {value}; axis values are >= 0")
                return self._eager(num_tokens, num_reqs, f"above_max_axis.{name}", axes)
            padded[i] = table[value]
        at = self._variants.get(tuple(padded))
        if at is None:
            return self._eager(num_tokens, num_reqs, "no_axis_combination", axes)
        return self._dispatch_tokens(num_tokens, num_reqs, uniform, at, axes, count)

    def _dispatch_tokens(
        self,
        num_tokens: int,
        num_reqs: int,
        uniform: bool,
        at: dict[GraphKey, GraphKey] | None,
        values: Any,
        count: bool = True,
    ) -> Dispatch:
        """The token keys' dispatch (`dispatch`); `at` maps each token key to its key at the step's padded axis
        values (None: no axes), `values` the step's own axis values (`StepBatch.axes`: its eager key's)."""
        if uniform:
            key = self._uniform[num_tokens]
            if at is not None and key is not None:
                key = at[key]
            if key is not None and key in self.captured:
                return Dispatch(Mode.FULL, key, "")
            if key is not None and count:  # traffic for its uniform key, whatever replays instead
                self.demand[key] += 1
            fallback = key
        else:
            fallback = None
        over = self._over_padding[num_tokens]  # every key of this count but the uniform one pads past the factor
        piece = self._piecewise[num_tokens]
        if piece is not None:  # piecewise keys hold any request count the buffers hold
            if over:
                return self._over_padding_of(num_tokens, num_reqs, fallback, values)
            if at is not None:
                piece = at[piece]
            if piece in self.captured:
                return Dispatch(Mode.PIECEWISE, piece, "")
            return self._eager(num_tokens, num_reqs, self._state(piece, count=count), values)
        keys = self._mixed[num_tokens]
        if not keys:  # full_decode_only plans no mixed keys
            if fallback is not None:
                reason = self._state(fallback, count=False)
            else:  # a uniform step whose uniform key pads past the factor: the guard decided
                reason = "over_padding" if uniform and self._uniform_over[num_tokens] else "decode_only"
            return self._eager(num_tokens, num_reqs, reason, values)
        fits: GraphKey | None = None  # the fewest rows that hold the step; a larger captured one replays instead
        for key in keys:  # mixed keys: num_reqs is set
            if key.num_reqs is not None and key.num_reqs >= num_reqs:
                if over:
                    return self._over_padding_of(num_tokens, num_reqs, fallback, values)
                if at is not None:
                    key = at[key]
                if key in self.captured:
                    return Dispatch(Mode.FULL, key, "")
                fits = fits or key
        if fits is None:  # every size's mixed keys hold min(size, max_num_seqs) requests: only more than that
            raise BatchError(
                f"batch has {num_reqs} requests, above batching.max_num_seqs {self.max_num_seqs}; "
                "the scheduler must split the step"
            )
        return self._eager(num_tokens, num_reqs, self._state(fits, count=count), values)

    @staticmethod
    def eager_key(num_tokens: int, num_reqs: int, axes: tuple[tuple[str, int], ...] = ()) -> GraphKey:
        """The key of an eager step: the step's own counts and axis values (`axis_values`), unpadded, mixed
        (no graph has it)."""
        return GraphKey(num_tokens, num_reqs, False, axes)

    def _eager(self, num_tokens: int, num_reqs: int, reason: str, axes: Any = None) -> Dispatch:
        """An eager dispatch; its key holds the step's own axis values (`axes`: the step's `StepBatch.axes`)."""
        return Dispatch(Mode.EAGER, GraphKey(num_tokens, num_reqs, False, self.axis_values(axes)), reason)

    def _over_padding_of(self, num_tokens: int, num_reqs: int, fallback: GraphKey | None, values: Any) -> Dispatch:
        """A step whose keys pad past the factor: `over_padding`, or the reason of its own uniform key (not
        captured, within the factor)."""
        reason = "over_padding" if fallback is None else self._state(fallback, count=False)
        return self._eager(num_tokens, num_reqs, reason, values)

    def _state(self, key: GraphKey, *, count: bool = True) -> str:
        """Why a step whose key is `key` (not captured) runs eagerly; counts the step in `demand`."""
        if key in self.skipped:
            return self.declined.get(key, "skipped")
        if count:
            self.demand[key] += 1
        return self.uncaptured_reason

    def _check_planned(self, key: GraphKey) -> None:
        if key not in self.planned:
            raise ValueError(f"{key} is not a planned key; keys come from the registry, not call sites")

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self.planned)

    def __len__(self) -> int:
        return len(self.planned)
