"""Capture sizes: the default schedule, validation, and the padding table.

A leaf module (no graphcap imports): `config.py` uses it to validate `capture.sizes`.

The padding table maps every token count `0..max_size` to the smallest captured size that
holds it. It is built once, so `CaptureSizes.pad(n)` on the hot path is one list index.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

__all__ = ["CaptureSizes", "default_capture_sizes", "uniform_sizes"]

# Where real decode batches concentrate, the schedule is dense; above, padding waste
# matters less than capture time and graph memory, so it thins out.
_DENSE_BELOW = 256
_DENSE_STEP = 8
_SPARSE_STEP = 16


def default_capture_sizes(max_size: int, uniform_query_len: int = 1) -> list[int]:
    """The default capture schedule up to and including `max_size`.

    `1, 2, 4`, then every 8 up to 256, then every 16, always ending at `max_size`. With
    `uniform_query_len=q > 1` (speculative decoding: each request verifies `q` tokens) every
    size is a multiple of `q`, so a batch of `r` uniform requests pads to whole requests.

    Raises `ValueError` when `max_size < 1`, `uniform_query_len < 1`, or `max_size` is not a
    multiple of `uniform_query_len`.
    """
    if not _is_int(max_size) or max_size < 1:
        raise ValueError(f"max_size must be an integer >= 1; got {max_size!r}")
    q = uniform_query_len
    if not _is_int(q) or q < 1:
        raise ValueError(f"uniform_query_len must be an integer >= 1; got {q!r}")
    if max_size % q:
        lower, upper = max_size - max_size % q, max_size - max_size % q + q
        raise ValueError(
            f"max_size {max_size} is not a multiple of uniform_query_len {q}; use {lower or upper} or {upper}"
        )
    base = [1, 2, 4]
    base += range(_DENSE_STEP, min(max_size, _DENSE_BELOW) + 1, _DENSE_STEP)
    base += range(_DENSE_BELOW + _SPARSE_STEP, max_size + 1, _SPARSE_STEP)
    # Round each candidate up to whole uniform requests; keep those within max_size.
    sizes = {-(-size // q) * q for size in base}
    sizes = {size for size in sizes if size <= max_size}
    sizes.add(max_size)
    return sorted(sizes)


def uniform_sizes(sizes: Iterable[int], uniform_query_len: int, max_num_seqs: int) -> list[int]:
    """Token counts of the uniform (decode / spec-decode) keys, ascending.

    Every captured size that is whole requests of `uniform_query_len` tokens, at most
    `max_num_seqs` of them; plus `max_num_seqs * uniform_query_len` itself when it lies within
    the largest size, so the biggest decode step the request pool allows always has its own
    key (as SGLang captures it), even when `max_num_seqs` is not a captured size.
    """
    sizes = list(sizes)
    q, top = uniform_query_len, max_num_seqs * uniform_query_len
    out = [size for size in sizes if size % q == 0 and size <= top]
    if sizes and top <= sizes[-1] and top not in out:
        out.append(top)
    return out


class CaptureSizes:
    """A validated, ascending set of captured token counts and its padding table.

    `.sizes` is an ascending tuple, `.max_size` the largest. `.pad(n)` returns the smallest
    captured size `>= n`, or `None` when `n` exceeds `.max_size` (that step runs eagerly).
    Immutable after construction. Does not know about requests or uniform batches: the
    manager's key registry builds on it.
    """

    __slots__ = ("sizes", "max_size", "max_num_tokens", "_table")

    def __init__(self, sizes: Iterable[int], max_num_tokens: int) -> None:
        sizes = tuple(sizes)
        if not _is_int(max_num_tokens) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be an integer >= 1; got {max_num_tokens!r}")
        if not sizes:
            raise ValueError("capture sizes are empty; give at least one size, e.g. [1, 2, 4, 8]")
        for i, size in enumerate(sizes):
            if not _is_int(size) or size < 1:
                raise ValueError(f"capture size [{i}] must be an integer >= 1; got {size!r}")
        for i in range(1, len(sizes)):
            if sizes[i] <= sizes[i - 1]:
                raise ValueError(
                    f"capture sizes must be ascending and unique; got {list(sizes)} "
                    f"([{i - 1}]={sizes[i - 1]}, [{i}]={sizes[i]})"
                )
        if sizes[-1] > max_num_tokens:
            raise ValueError(
                f"capture size {sizes[-1]} exceeds max_num_tokens {max_num_tokens}; "
                f"the persistent buffers cannot hold it: lower the size or raise max_num_tokens"
            )
        self.sizes: tuple[int, ...] = sizes
        self.max_size: int = sizes[-1]
        self.max_num_tokens: int = max_num_tokens
        table = [0] * (self.max_size + 1)
        lo = 0
        for size in sizes:
            table[lo : size + 1] = [size] * (size + 1 - lo)
            lo = size + 1
        self._table: list[int] = table

    def pad(self, num_tokens: int) -> int | None:
        """Smallest captured size `>= num_tokens`; `None` above `.max_size`. O(1)."""
        if num_tokens > self.max_size:
            return None
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0; got {num_tokens}")
        return self._table[num_tokens]

    def padded_counts(self) -> tuple[int, ...]:
        """`pad(n)` of every token count `n` in `0..max_size`, by index."""
        return tuple(self._table)

    def padding_table(self) -> list[tuple[int, int, int]]:
        """`(first, last, padded)` ranges: every token count in `[first, last]` pads to `padded`."""
        rows, lo = [], 1
        for size in self.sizes:
            rows.append((lo, size, size))
            lo = size + 1
        return rows

    def expected_waste(self, histogram: Mapping[int, float] | None = None) -> float:
        """Fraction of replayed tokens that are padding, over a batch-size histogram.

        `histogram` maps a real token count to its frequency; `None` means every count in
        `1..max_size` is equally likely. Counts above `max_size` run eagerly and waste nothing.
        """
        if histogram is None:
            histogram = dict.fromkeys(range(1, self.max_size + 1), 1.0)
        real = padded = 0.0
        for num_tokens, weight in histogram.items():
            target = self.pad(num_tokens)
            if target is None or num_tokens < 1:
                continue
            real += num_tokens * weight
            padded += target * weight
        return 0.0 if padded == 0 else (padded - real) / padded

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[int]:
        return iter(self.sizes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CaptureSizes):
            return NotImplemented
        return (self.sizes, self.max_num_tokens) == (other.sizes, other.max_num_tokens)

    def __hash__(self) -> int:
        return hash((self.sizes, self.max_num_tokens))

    def __repr__(self) -> str:
        return f"CaptureSizes({list(self.sizes)}, max_num_tokens={self.max_num_tokens})"


def _is_int(value: object) -> bool:
    # bool is an int subclass; a size of `True` is a YAML accident, not a size.
    return isinstance(value, int) and not isinstance(value, bool)
