"""Engine buffers (`BufferSpec`) in staging: their real rows from a step, their padded rows, their checks.

`PersistentBuffers` lays them out beside the built-in fields; this module holds what staging
does with them, so the built-in hot path stays free of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from graphcap.config.buffers import BufferConfig, cumulative_tail, real_rows
from graphcap.errors import BatchError, ConfigError, ConfigProblem
from graphcap.inputs import AxesSampler, BufferSpec, Sampler

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

__all__ = [
    "check_extras",
    "check_extras_fit",
    "cumulative_tail",
    "default_sample",
    "domain_hint",
    "full_shape",
    "merged_specs",
    "pad_extra",
    "real_rows",
    "rows",
    "sampled",
    "stage_extra",
]

_DECLARED = ("rows", "shape", "dtype", "pad", "row_dim", "domain")


def merged_specs(entries: tuple[BufferConfig, ...], specs: Iterable[BufferSpec]) -> tuple[BufferSpec, ...]:
    """The engine buffers of a manager: the config's `buffers:` list merged by name with those passed in code.

    A name in both is one buffer when both declare it alike (the code's spec is kept: it may carry
    `check` and `sample`); declared differently, it is a `ConfigError` naming both. Code-only
    buffers follow the config's, in the order given.
    """
    if isinstance(specs, BufferSpec) or not isinstance(specs, Iterable):
        raise TypeError(f"buffers must be a list of graphcap.BufferSpec; got {type(specs).__name__}")
    specs = tuple(specs)
    by_name = {spec.name: spec for spec in specs if isinstance(spec, BufferSpec)}
    out, taken, problems = [], set(), []
    for i, entry in enumerate(entries):
        spec, declared = by_name.get(entry.name), BufferSpec.from_config(entry)
        if spec is None:
            out.append(declared)
            continue
        differ = [f"{f} {getattr(declared, f)!r} vs {getattr(spec, f)!r}" for f in _DECLARED
                  if getattr(declared, f) != getattr(spec, f)]  # fmt: skip
        if differ:
            problems.append(ConfigProblem(f"buffers[{i}]", f"{entry.name!r} is also passed in code as a BufferSpec, "
                            f"declared differently ({', '.join(differ)}; config vs code): declare it in one place, "
                            "or alike in both"))  # fmt: skip
        out.append(spec)
        taken.add(id(spec))
    if problems:
        raise ConfigError(problems)
    return (*out, *(spec for spec in specs if id(spec) not in taken))


def check_extras(extras: tuple[BufferSpec, ...]) -> None:
    """Every declared buffer is a `BufferSpec` with its own name."""
    names = set()
    for spec in extras:
        if not isinstance(spec, BufferSpec):
            raise TypeError(f"buffers must be graphcap.BufferSpec; got {type(spec).__name__}")
        if spec.name in names:
            raise ValueError(f"buffer {spec.name!r} is declared twice; give each BufferSpec its own name")
        names.add(spec.name)


def check_extras_fit(
    extras: tuple[BufferSpec, ...], values: Mapping[str, np.ndarray], num_tokens: int, num_reqs: int
) -> None:
    """Refuse (`BatchError`) a step's engine-buffer rows that are undeclared, misshapen or out of range."""
    declared = {spec.name: spec for spec in extras}
    for name, value in values.items():
        spec = declared.get(name)
        if spec is None:
            known = ", ".join(declared) or "none"
            raise BatchError(f"extras[{name!r}]: no such buffer; declared buffers: {known} (BufferSpec)")
        real = real_rows(spec, num_tokens, num_reqs)
        expected = real_shape(spec, real)
        if value.shape != expected:
            raise BatchError(
                f"extras[{name!r}] has shape {tuple(value.shape)}; expected {expected} "
                f"({spec.rows} rows{'' if real is None else f' = {real}'}, shape {spec.shape}, "
                f"row_dim {spec.row_dim})"
            )
        _check_extra_values(spec, value)


def sampled(
    extras: tuple[BufferSpec, ...],
    rng: np.random.Generator,
    num_tokens: int,
    num_reqs: int,
    axes: Mapping[str, int] | None = None,
    *,
    capture: bool = False,
) -> dict:
    """Real rows of every sampled buffer (`BufferSpec.is_sampled`) for a batch graphcap makes (capture,
    verification): from its `sample`, or by default from its dtype, pad and domain (`default_sample`).
    `capture`: the batch a key is recorded with; the default samples of every other batch differ from
    it in their first real value, so a graph that froze the recording's values is seen to differ.

    A `sample` with an `axes` parameter is called `sample(rng, num_real_rows, axes=...)` with the batch's
    key-axis values (`capture.axes`), so rows that index axis slots stay below the batch's value."""
    out = {}
    for spec in extras:
        sample = spec.sample
        if isinstance(sample, str) or not spec.is_sampled:  # a str: "pad", every row holds the pad
            continue
        real = real_rows(spec, num_tokens, num_reqs) or 0
        expected = real_shape(spec, None if spec.rows == "none" else real)
        if sample is None:
            out[spec.name] = default_sample(spec, rng, expected, unlike_capture=not capture)
            continue
        try:
            if _takes_axes(sample):
                value = np.asarray(sample(rng, real, axes=dict(axes or {})))
            else:
                value = np.asarray(sample(rng, real))
        except Exception as exc:
            raise ValueError(
                f"BufferSpec {spec.name!r}: sample(rng, {real}) raised {type(exc).__name__}: {exc}; it must return "
                f"the real rows of a batch graphcap makes, shape {expected}"
            ) from exc
        if value.shape != expected:
            raise ValueError(
                f"BufferSpec {spec.name!r}: sample(rng, {real}) returned shape {value.shape}; expected {expected} "
                f"({_ROW_WORDS[spec.rows]} of the batch)"
            )
        out[spec.name] = value
    return out


def default_sample(
    spec: BufferSpec, rng: np.random.Generator, shape: tuple[int, ...], *, unlike_capture: bool = False
) -> np.ndarray:
    """Rows of `shape` for a float or bool buffer without a `sample`, unlike each other.

    Floats: uniform within the buffer's `domain`, or else within `pad * [0.5, 2]` (a pad of 0 or not
    finite: `[0.5, 2]`) cut to half the dtype's largest value, as the dtype stores them. Booleans at random.
    The first value is the interval's low end (False) in the batch a key is recorded with, and never
    that value with `unlike_capture` (verification batches): so a verification batch always differs from
    the recording's in a real row, the first, which every batch with a real row holds."""
    if spec.np_dtype.kind == "b":
        out = rng.random(shape) < 0.5
        if out.size:
            out.flat[0] = unlike_capture
        return out
    low, high = _stored_within(spec.np_dtype.type, *_sample_interval(spec))
    out = np.clip(rng.uniform(low, high, shape).astype(spec.np_dtype), low, high)
    if out.size:
        if not unlike_capture:
            out.flat[0] = low
        elif out.flat[0] == low:
            out.flat[0] = high
    return out


def _stored_within(kind: type, low: float, high: float) -> tuple[np.floating, np.floating]:
    """The smallest and largest values of float type `kind` within `[low, high]` (rounding may step outside)."""
    lo, hi = kind(low), kind(high)
    if lo < low:
        lo = np.nextafter(lo, kind(np.inf))
    if hi > high:
        hi = np.nextafter(hi, kind(-np.inf))
    return lo, hi


def _sample_interval(spec: BufferSpec) -> tuple[float, float]:
    """`[low, high]` of a float buffer's default samples: its domain, else around its pad (two values its dtype
    stores apart)."""
    if spec.domain is not None:
        return spec.domain
    scale = float(spec.pad) if spec.pad and np.isfinite(float(spec.pad)) else 1.0
    largest = float(np.finfo(spec.np_dtype).max) / 2
    low, high = sorted((float(np.clip(scale * 0.5, -largest, largest)), float(np.clip(scale * 2.0, -largest, largest))))
    if spec.np_dtype.type(low) == spec.np_dtype.type(high):  # a pad too small to tell its halves apart
        return 0.5, 2.0
    return low, high


def domain_hint(extras: tuple[BufferSpec, ...], replayed: list, expected: list) -> str | None:
    """Why a replay and its eager run differ when both hold NaN or inf at the same places and some float buffer
    was sampled without a `domain`: the samples may have left the values' domain (None: not that case).
    `replayed`, `expected`: the two runs' output tensors, in order."""
    guessed = [
        spec.name for spec in extras if spec.sample is None and spec.domain is None and spec.np_dtype.kind == "f"
    ]
    if not guessed or len(replayed) != len(expected):
        return None
    both = 0
    for a, b in zip(replayed, expected):
        if not (a.is_floating_point() and b.is_floating_point()) or a.shape != b.shape:
            continue
        bad_a, bad_b = ~a.isfinite(), ~b.isfinite()
        if bool((bad_a != bad_b).any()):
            return None
        both += int(bad_a.sum())
    if not both:
        return None
    names = ", ".join(map(repr, guessed))
    return (
        f"replay and eager both hold NaN or inf at the same {both} places: the values graphcap sampled for the float "
        f"engine buffer(s) {names} (within pad * [0.5, 2], no domain declared) may lie outside what the forward "
        "accepts (a probability above 1). Declare BufferSpec(domain=(low, high)) (buffers: domain: [low, high]), or "
        "give the buffer a sample"
    )


def _takes_axes(sample: Sampler | AxesSampler) -> TypeIs[AxesSampler]:
    try:
        return "axes" in inspect.signature(sample).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the two-argument form
        return False


def stage_extra(host: np.ndarray, spec: BufferSpec, value: np.ndarray | None, T: int, R: int, n: int, r: int) -> None:
    """Real rows of an engine buffer from the step (checked by `check_extras_fit`), then its pad."""
    if spec.rows == "none":
        host[...] = spec.pad if value is None else value
        return
    if spec.rows == "reqs+1":  # [R + 1] offsets: the step's r + 1, or 0 alone (every request owns nothing)
        if value is None:
            host[0], r = 0, 0
        else:
            host[: r + 1] = value
        pad_extra(host, spec, T, R, n, r)
        return
    real = n if spec.rows == "tokens" else r
    if value is not None and real:
        host[rows(spec, 0, real)] = value
    pad_extra(host, spec, T, R, n if value is not None else 0, r if value is not None else 0)


def pad_extra(host: np.ndarray, spec: BufferSpec, T: int, R: int, n: int, r: int) -> None:
    """Padded rows of an engine buffer (a `none` buffer: all of it) hold its pad."""
    if spec.rows == "none":
        host[...] = spec.pad
        return
    if spec.rows == "reqs+1":  # entries r+1..R: the last real one, plus the pad step per padded request
        if r < R:
            host[r + 1 : R + 1] = cumulative_tail(spec, int(host[r]), R - r)
        return
    lo, hi = (n, T) if spec.rows == "tokens" else (r, R)
    if lo < hi:
        host[rows(spec, lo, hi)] = spec.pad


def full_shape(spec: BufferSpec, T: int, R: int) -> tuple[int, ...]:
    return real_shape(spec, {"tokens": T, "reqs": R, "reqs+1": R + 1, "none": None}[spec.rows])


_ROW_WORDS = {"tokens": "one row per real token", "reqs": "one row per real request",
              "reqs+1": "one entry per real request and a leading 0", "none": "the whole tensor"}  # fmt: skip


def real_shape(spec: BufferSpec, num_rows: int | None) -> tuple[int, ...]:
    if spec.rows == "none" or num_rows is None:  # None: the rows of a `none` buffer
        return spec.shape
    shape = list(spec.shape)
    shape.insert(spec.row_dim, num_rows)
    return tuple(shape)


def rows(spec: BufferSpec, lo: int, hi: int) -> tuple:
    """Index of rows `[lo, hi)` along the spec's row axis."""
    return (slice(None),) * spec.row_dim + (slice(lo, hi),)


def _check_extra_values(spec: BufferSpec, value: np.ndarray) -> None:
    dtype = spec.np_dtype
    if value.size == 0:
        return
    if dtype.kind == "b":
        if value.dtype.kind != "b":
            raise BatchError(f"extras[{spec.name!r}] must hold booleans; got dtype {value.dtype}")
        return
    if value.dtype.kind not in "iub" + ("f" if dtype.kind == "f" else ""):
        want = "numbers" if dtype.kind == "f" else "integers"
        raise BatchError(f"extras[{spec.name!r}] must hold {want} for dtype {spec.dtype}; got dtype {value.dtype}")
    if dtype.kind == "f":
        _check_finite_stored(spec, value)
        return
    info = np.iinfo(dtype)
    low, high = int(value.min()), int(value.max())
    if low < info.min or high > info.max:
        bad = value < info.min if low < info.min else value > info.max
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise BatchError(
            f"extras[{spec.name!r}]{list(index)} is {int(value[index])}, outside the range of {spec.dtype} "
            f"[{info.min}, {info.max}]"
        )


def _check_finite_stored(spec: BufferSpec, value: np.ndarray) -> None:
    """Every value stays finite as the buffer stores it: the check runs after the cast to its dtype
    (1e6 or 70000.0 is finite as given but inf in float16)."""
    with np.errstate(over="ignore", invalid="ignore"):
        stored = value.astype(spec.np_dtype, copy=False)
    if np.isfinite(stored).all():
        return
    index = tuple(int(i) for i in np.argwhere(~np.isfinite(stored))[0])
    given = value[index]
    where = f"extras[{spec.name!r}]{list(index)}"
    if value.dtype.kind == "f" and not np.isfinite(given):
        raise BatchError(f"{where} is {given}; values must be finite")
    largest = float(np.finfo(spec.np_dtype).max)
    raise BatchError(
        f"{where} is {given}, which {spec.dtype} stores as {stored[index]} (its largest finite value is "
        f"{largest:g}); values must be finite as stored: scale them, or declare the buffer with a wider dtype"
    )
