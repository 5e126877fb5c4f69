"""Capture verification: a graph replays staged inputs and its real rows must match an eager run.

`compare_replay` is the one check: replay `graph` on the staged `inputs`, run `eager()` (the
expected real rows), compare with `torch.testing.assert_close` at the configured tolerance, and
raise `ReplayMismatchError(message(difference))` when they differ. A capture pass's `Verifier` runs it
per key, after the pass's context has exited: on the capture's own dummy batch, and on a
`probe_batch` at each of `probe_fills(key)` (one real token, about half, all but one; requests
likewise), each unlike the dummy in every value, so padded rows run in every share and a host value
the graph froze at capture (a Python count, an `.item()`) shows. A key that admits no smaller batch
is verified on full batches only, and its record says so. Where a key is verified
right after its capture (no engine context, no peers), the dummy batch's expected rows are its last
warmup's output (`LastRun`), which ran that batch eagerly just before: the same reads, one forward fewer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from graphcap.backends import CapturedGraph, GraphBackend
from graphcap.capture.failures import failing_in
from graphcap.errors import CaptureError, ReplayMismatchError
from graphcap.inputs import ForwardInputs
from graphcap.keys import GraphKey
from graphcap.outputs import OutputRows, cloned, flatten_output
from graphcap.piecewise import running

__all__ = [
    "DUMMY_MISMATCH",
    "NORM_TOLERANCE",
    "LastRun",
    "assert_close",
    "axes_mismatch",
    "compare_replay",
    "difference",
    "differs",
    "probe_mismatch",
]

DUMMY_MISMATCH = (
    "replay differs from eager on the same inputs ({diff}); the forward depends on something the "
    "graph froze (a Python value, a host tensor, randomness)"
)


def probe_mismatch(
    num_tokens: int, num_reqs: int, padded_tokens: int, padded_reqs: int, writes_kv: bool
) -> Callable[[str], str]:
    """The message of a probe batch (`num_tokens` of `padded_tokens`, ...) whose replay differs from eager."""
    read_only = (
        ""
        if writes_kv
        else " The batch ran without scratch blocks, so its tokens wrote no KV slot (each had the pad slot): "
        "if the forward reads this step's keys back through slot_mapping, pass capture(scratch_blocks=<free "
        "block ids>) so verification can write them."
    )
    partly = num_tokens < padded_tokens or num_reqs < padded_reqs
    what = "a partly filled batch" if partly else "a full batch of other values (no smaller batch fits the key)"
    return lambda diff: (
        f"replay differs from eager on {what} ({num_tokens} of {padded_tokens} tokens, "
        f"{num_reqs} of {padded_reqs} requests, other token ids, lengths and blocks: {diff}). The graph froze a "
        "host value at capture (a Python number read from inputs.host or inputs.num_tokens / num_reqs, a value "
        "prepare() computed, an .item()), or padded rows leak into real ones. Read per-step values only as "
        "tensors of ForwardInputs (or of your own BufferSpec buffers that prepare() fills), give padded tokens "
        f"a sink, and never slice by a Python count.{read_only}"
    )


def axes_mismatch(key: GraphKey, lowered: tuple[tuple[str, int], ...]) -> Callable[[str], str]:
    """The message of a key whose replay at `lowered` axis values differs from eager at those values."""
    changed = [(name, dict(key.axes)[name], value) for name, value in lowered if value != dict(key.axes)[name]]
    shown = ", ".join(f"{name} {value} (the graph holds {held})" for name, held, value in changed)
    names = ", ".join(name for name, _, _ in changed)
    return lambda diff: (
        f"replay of {key} differs from eager on its dummy batch stating capture.axes {shown}: {diff}. The model "
        f"is not neutral to padded {names} slots: a step pads each axis up to a captured value, so the slots "
        f"beyond its own value run in the graph and must leave every real row unchanged (mask them, as padded "
        f"rows are masked: e.g. an adapter slot no token uses must add nothing)"
    )


def compare_replay(
    graph: CapturedGraph,
    inputs: ForwardInputs,
    eager: Callable[[], Any],
    *,
    tolerance: Mapping[str, float],
    backend: GraphBackend,
    message: Callable[[str], str] | str,
    outputs: OutputRows,
    timings: dict[str, float] | None = None,
    precision: torch.dtype | None = None,
    diagnose: Callable[[Any, Any], str | None] | None = None,
) -> float:
    """Replay `graph` on the staged `inputs`, then run `eager()` (the expected real rows) and compare.

    Returns the seconds `eager()` took (capture time that is not graph work); `timings`, when given,
    receives the seconds of the replay and of `eager()` (`replay`, `eager`). Raises
    `ReplayMismatchError(message(first lines of the difference))` when the real rows differ beyond
    `tolerance` (`torch.testing.assert_close` keywords); a str `message` is formatted with `diff`.
    `outputs` cuts both to their real rows; a replay whose real rows have another shape than the
    eager run's (a wrong cut) raises `CaptureError` naming the output and its declaration.
    `precision`: the model's lowest floating compute dtype; a 16-bit one judges floating outputs of any
    dtype (a model that computes in bfloat16 and returns float32 logits) as 16-bit ones. `diagnose(replayed,
    expected)`, when the rows differ: a message that replaces `message`'s (None: keep it), e.g. naming
    state the forward carries between runs (`graphcap.capture.carried`).
    """
    backend.synchronize()
    t0 = time.perf_counter()
    with failing_in("the verification replay"), running(inputs):  # eager ops between pieces read current_inputs()
        output = graph.replay()
        backend.synchronize()
    replay_seconds = time.perf_counter() - t0
    output = cloned(output)
    replayed = outputs.real(output, inputs)
    backend.synchronize()
    t0 = time.perf_counter()
    with failing_in("the eager reference run"), torch.inference_mode():
        expected = eager()
        backend.synchronize()  # time the GPU work, not the launches
    seconds = time.perf_counter() - t0
    if timings is not None:  # one sample of each side, on the same inputs: what capture records as `speedup`
        timings.update(replay=replay_seconds, eager=seconds)
    wrong_cut = outputs.mismatch(output, expected, inputs)
    if wrong_cut is not None:
        raise CaptureError(wrong_cut)
    diff = difference(replayed, expected, tolerance, precision)
    if diff is not None:
        why = diagnose(replayed, expected) if diagnose is not None else None
        text = why or (message.format(diff=diff) if isinstance(message, str) else message(diff))
        raise ReplayMismatchError(text, inputs.key, 0, "output")
    return seconds


def differs(tolerance: Mapping[str, float], precision: torch.dtype | None = None) -> Callable[[Any, Any], bool]:
    """Whether two real-row results differ as `compare_replay` judges them."""
    return lambda a, b: difference(a, b, tolerance, precision) is not None


class LastRun:
    """The output of a key's last warmup (`keep(output)`: its real rows, copied) and how long that run took.

    `around(run, calls, backend, keep)` gives the warmup forward that fills it on the last of its `calls` runs;
    `output` stays None until then (no warmup ran, or the warmups failed). `first`: that run was the batch's first
    (`calls` 1), so it read no state an earlier run left, as the replay after the recording does.
    """

    def __init__(self) -> None:
        self.output: Any = None
        self.seconds = 0.0
        self.first = False

    def around(
        self, run: Callable[[], Any], calls: int, backend: GraphBackend, keep: Callable[[Any], Any]
    ) -> Callable[[], Any]:
        self.first = calls == 1
        left = [calls]

        def warmup() -> Any:
            left[0] -= 1
            if left[0] > 0:
                return run()
            backend.synchronize()
            t0 = time.perf_counter()
            output = run()
            backend.synchronize()  # the GPU work, not the launches
            self.seconds = time.perf_counter() - t0
            self.output = keep(output)
            return output

        return warmup


NORM_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
"""Norm-relative tolerance of 16-bit outputs when `checks.atol/rtol` are not given: a replay at the
padded shape and an eager run at the real shape run other GEMM kernels, so elementwise closeness
of millions of 16-bit logits is not a fair test; `|replay - eager| / |eager|` (Frobenius) is. The
same holds for float32 outputs of a model that computes in 16 bits (its `precision`)."""


def difference(
    replayed: Any, expected: Any, tolerance: Mapping[str, float], precision: torch.dtype | None = None
) -> str | None:
    """None when `replayed` matches `expected`, else the first lines of what differs.

    Explicit `tolerance` (atol/rtol), or 32/64-bit tensors of a model that computes in 32/64 bits:
    `torch.testing.assert_close`. 16-bit tensors, or floating tensors of a model whose `precision`
    is 16-bit, without explicit tolerance: the norm-relative error within `NORM_TOLERANCE`, with
    non-finite values where eager has them.
    """
    left, right = flatten_output(replayed, "verification"), flatten_output(expected, "verification")
    pairs = list(zip(left[0], right[0])) if len(left[0]) == len(right[0]) else []

    def judged_as(a: torch.Tensor) -> torch.dtype | None:  # the 16-bit dtype whose tolerance judges `a`
        if a.dtype in NORM_TOLERANCE:
            return a.dtype
        return precision if precision in NORM_TOLERANCE and a.is_floating_point() else None

    if tolerance or not pairs or not any(judged_as(a) is not None for a, _ in pairs):
        if _same_structure(replayed, expected) and all(_surely_close(a, b, tolerance) for a, b in pairs):
            return None
        try:
            torch.testing.assert_close(replayed, expected, rtol=tolerance.get("rtol"), atol=tolerance.get("atol"))
        except AssertionError as exc:
            return "; ".join(str(exc).strip().splitlines()[:3])
        return None
    for i, (a, b) in enumerate(pairs):
        judged = judged_as(a)
        if judged is None or a.shape != b.shape or a.dtype != b.dtype:
            if _surely_close(a, b, tolerance):
                continue
            try:
                torch.testing.assert_close(a, b)
            except AssertionError as exc:
                return f"output {i}: " + "; ".join(str(exc).strip().splitlines()[:3])
            continue
        error = _norm_relative(a, b)
        if error is None:
            return f"output {i}: non-finite values where eager has finite ones (or the reverse)"
        if error > NORM_TOLERANCE[judged]:
            computed = "" if judged == a.dtype else f", computed in {judged}"
            return f"output {i} ({a.dtype}{computed}): norm-relative error {error:.3g} > {NORM_TOLERANCE[judged]:g}"
    return None


_CHUNK = 1 << 16
"""Elements per step of `_norm_relative`: its float64 temporaries stay at a few hundred KiB whatever the
output's size (the memory estimate counts the comparison's working set at a few copies of the output)."""


def _norm_relative(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """`|a - b| / |b|` (Frobenius, float64) over the finite entries; None where `a` and `b` are not finite
    at the same places."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    squares, reference = 0.0, 0.0
    for start in range(0, flat_b.numel(), _CHUNK):
        x, y = flat_a[start : start + _CHUNK].double(), flat_b[start : start + _CHUNK].double()
        finite = torch.isfinite(y)
        if not torch.equal(torch.isfinite(x), finite):
            return None
        x, y = x.where(finite, 0.0), y.where(finite, 0.0)
        squares += float((x - y).square().sum())
        reference += float(y.square().sum())
    return math.sqrt(squares) / max(math.sqrt(reference), 1e-30)


_ASSERT_CLOSE_DEFAULTS = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}
"""`torch.testing.assert_close`'s documented default (rtol, atol) by dtype; integers and booleans compare exactly."""


def _surely_close(a: torch.Tensor, b: torch.Tensor, tolerance: Mapping[str, float]) -> bool:
    """True only where `torch.testing.assert_close(a, b, **tolerance)` passes: same shape, dtype and device,
    every element within `atol + rtol * |b|` (a NaN never is). False means "ask assert_close", which also
    writes the message. The check is the same; this path skips assert_close's per-call set-up (on torch 2.13
    its first call imports the DTensor stack, about a second)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return False
    if a.is_floating_point() or a.is_complex():
        defaults = _ASSERT_CLOSE_DEFAULTS.get(a.dtype)
        if defaults is None and not tolerance:
            return False
        if tolerance:
            rtol, atol = tolerance["rtol"], tolerance["atol"]
        elif defaults is not None:
            rtol, atol = defaults
        return bool(torch.allclose(a, b, rtol=rtol, atol=atol))
    return not tolerance and torch.equal(a, b)


def _same_structure(a: Any, b: Any) -> bool:
    """Both a tensor, both a list or tuple of the same length, or both a dict with the same keys."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b)
    return type(a) is type(b) and len(a) == len(b)


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str | Callable[[str], str] | None = None,
) -> None:
    """`torch.testing.assert_close` with the same verdict, decided by `torch.allclose` where it can.

    Tensors, or tuples, lists and dicts of them, compared element by element at assert_close's
    tolerances (its defaults by dtype, or `rtol` and `atol` together). Only a mismatch, or an input
    the fast path does not judge, calls `torch.testing.assert_close`, which writes the message: on
    torch 2.13 its first call in a process imports the DTensor stack and sympy (seconds on a loaded
    machine), which every short-lived process (a tool, a rank of a multi-process test) would pay.
    """
    given = rtol is not None and atol is not None
    tolerance: dict[str, float] = {"rtol": rtol, "atol": atol} if rtol is not None and atol is not None else {}
    if (given or (rtol is None and atol is None)) and _same_structure(actual, expected):
        try:
            left, right = flatten_output(actual, "comparison")[0], flatten_output(expected, "comparison")[0]
        except CaptureError:  # a structure the fast path does not judge: assert_close does
            left, right = [], []
            judged = False
        else:
            judged = len(left) == len(right)
        if judged and all(_surely_close(a, b, tolerance) for a, b in zip(left, right)):
            return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)
