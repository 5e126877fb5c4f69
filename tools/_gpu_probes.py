"""gpu_check cases that probe failure paths and the rules around capture: a real OOM in the first
capture (the rest of the pass must still capture), a capture CUDA invalidates (nothing may stay
recording), a sticky device assert (the pass stops with one message), the preflight table on real
CUDA, and torch.compile (captures run the compiled code). Each case is `(device, quick) -> dict`
with `ok` (as predicted), `observed` (one line) and its numbers."""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
from _gpu_steps import tiny_config

from graphcap import CaptureError, CaptureManager
from graphcap.backends import CaptureUnsafeError, check_capture_safe, get_backend
from graphcap.backends.preflight import sync_debug_errors
from graphcap.capture.verification import assert_close
from graphcap.models import build_model
from graphcap.phases import phase

SIZES = {"capture.sizes": [1, 2, 4, 8], "capture.on_error": "skip"}
NO_CUDA = {"ok": True, "observed": "skipped: no CUDA"}


class _Faulty(torch.nn.Module):
    """The reference model, with `fault(inputs, call)` run before the forward of one key."""

    def __init__(self, inner: torch.nn.Module, fault) -> None:
        super().__init__()
        self.inner, self.fault = inner, fault
        self.key = None
        self.calls: list = []

    def forward(self, inputs):
        self.calls.append(inputs.key)
        if inputs.key == self.key:
            self.fault(inputs, self.calls.count(self.key))
        return self.inner(inputs)


def _faulty_manager(device: str, pick: int, fault) -> CaptureManager:
    """A manager whose model runs `fault` for the `pick`-th key of the capture order."""
    config = tiny_config(device, True, **SIZES)
    model = _Faulty(build_model(config), fault)
    manager = CaptureManager(model, config, progress=False)
    model.key = manager.registry.capture_order()[pick]
    return manager


def oom_first_key(device: str, quick: bool) -> dict:
    on_cuda = device.startswith("cuda")
    # Sized before capture: no memory query while the stream captures.
    too_much = 2 * torch.cuda.get_device_properties(device).total_memory if on_cuda else 0

    def fault(inputs, call):
        capturing = torch.cuda.is_current_stream_capturing() if on_cuda else phase() == "capture"  # the recording
        if capturing:
            scratch = torch.ones(1 << 20, device=device)  # a block of the graph pool, pinned by the error
            if on_cuda:  # a real allocator OOM, twice the free memory
                torch.empty(too_much, dtype=torch.uint8, device=device)
            raise torch.OutOfMemoryError(f"out of memory (simulated on the CPU; {scratch.numel()} floats held)")

    manager = _faulty_manager(device, 0, fault)
    report = manager.capture()
    planned = len(report.records)
    reason = report.skipped[0].reason[:90] if report.skipped else "none"
    observed = f"first key OOM: {len(report.captured)} of {planned} keys captured after it (skipped: {reason})"
    return {"ok": len(report.captured) == planned - 1, "observed": observed}


def invalidated_capture(device: str, quick: bool) -> dict:
    if not device.startswith("cuda"):
        return NO_CUDA

    def fault(inputs, call):
        if torch.cuda.is_current_stream_capturing():  # a path only capture takes: the preflight cannot see it
            torch.cuda.synchronize()  # error 900: CUDA invalidates the capture (a pageable copy torch refuses first)

    manager = _faulty_manager(device, 1, fault)  # the pool already holds a graph
    report = manager.capture()
    usable = _context_usable(device)
    draws = _generators_draw(device)
    full_reason = report.skipped[0].reason if report.skipped else "none"
    reason = full_reason[:120]
    planned = len(report.records)
    invalidated = "CUDA invalidated the capture" in full_reason
    observed = f"{len(report.captured)} of {planned} captured (skipped: {reason}); afterwards {usable}, {draws}"
    ok = len(report.captured) == planned - 1 and invalidated and usable == "CUDA usable" and draws == "generators draw"
    return {"ok": ok, "observed": observed}


def _generators_draw(device: str) -> str:
    """Whether the default CUDA generator draws eagerly (a failed capture_end can leave it in capture mode)."""
    try:
        torch.rand(4, device=device)
        torch.cuda.synchronize(device)
    except RuntimeError as exc:
        return f"generators refuse: {str(exc).strip().splitlines()[0][:100]}"
    return "generators draw"


def _context_usable(device: str) -> str:
    if torch.cuda.is_current_stream_capturing():
        return "still capturing"
    if torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        return "a side stream left current"
    value = float((torch.ones(4, device=device) * 2).sum())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return "CUDA usable" if value == 8.0 else f"wrong arithmetic ({value})"


def sticky_assert(device: str, quick: bool) -> dict:
    if not device.startswith("cuda"):
        return NO_CUDA

    def fault(inputs, call):
        if call == 2:  # the plain warmup (the preflight does not sync, so it passes)
            inputs.input_ids.float()[torch.full((1,), 1 << 30, device=device)].sum()  # device-side assert

    manager = _faulty_manager(device, 1, fault)
    try:
        manager.capture()
        return {"ok": False, "observed": "the pass went on after a device-side assert", "poisoned": True}
    except CaptureError as exc:
        message = str(exc)
    calls, key = manager.model.calls, manager.model.key
    tried_after = {str(k) for k in calls[calls.index(key) :] if k != key}  # keys blamed after the assert
    ok = "sticky" in message and "CUDA_LAUNCH_BLOCKING=1" in message and not tried_after
    observed = f"one CaptureError ({message[:150]}...); keys tried after it: {sorted(tried_after) or 'none'}"
    return {"ok": ok, "observed": observed, "poisoned": True, "message": message}


def _forms(device: str) -> dict:
    """Forward forms and what the preflight must say about each (the op it names, or None)."""
    x = torch.randn(8, 64, device=device)
    mask, host, fill = x > 0, torch.ones(8, 64), torch.zeros((), device=device)
    return {
        "x.sum().item()": (lambda: x.sum().item(), "Tensor.item"),
        "aten.nonzero(x)": (lambda: torch.ops.aten.nonzero.default(x), "aten.nonzero"),
        "x.cpu()": (lambda: x.cpu(), "Tensor.cpu"),
        "torch.tensor(list, device=cuda)": (lambda: torch.tensor([1.0, 2.0], device=device), "torch.tensor"),
        "host.to(cuda)": (lambda: host.to(x.device), "aten._to_copy"),
        "x.copy_(host)": (lambda: torch.ops.aten.copy_.default(x.clone(), host), "aten.copy_"),
        "host.copy_(x)": (lambda: torch.ops.aten.copy_.default(host.clone(), x), "aten.copy_"),
        "x.masked_fill_(mask, 0-dim cuda)": (lambda: x.clone().masked_fill_(mask, fill), "aten.masked_fill_"),
        "x[mask] = 0.0": (lambda: torch.ops.aten.index_put_.default(x.clone(), [mask], torch.tensor(0.0)), None),
        "torch.cuda.synchronize()": (lambda: torch.cuda.synchronize(), "torch.cuda.synchronize"),
    }


def _verdict(fn, device: str) -> str | None:
    try:
        check_capture_safe(fn, device)
    except CaptureUnsafeError as exc:
        return exc.op
    return None


def preflight_table(device: str, quick: bool) -> dict:
    on_cuda = device.startswith("cuda")
    target = device if on_cuda else "cuda"
    fake = nullcontext()
    if not on_cuda:  # fake CUDA tensors: the verdicts the preflight gives on a GPU
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        forms = _forms(target)
        verdicts = {name: _verdict(fn, target) for name, (fn, _) in forms.items()}
    wrong = [
        n for n, (_, want) in forms.items() if not (verdicts[n] or "").startswith(want or "\0") and verdicts[n] != want
    ]
    result = {"verdicts": verdicts, "wrong": wrong}
    if on_cuda:
        result["sync_debug_alone"] = {name: _syncs(fn) for name, (fn, _) in forms.items()}
        result["raw_capture"] = _raw_captures(forms, device)
    raw_ok = all(
        v in ("captured, equals eager", "invalidated, next capture works", "refused by torch, next capture works")
        for v in result.get("raw_capture", {}).values()
    )
    flagged = sum(v is not None for v in verdicts.values())
    tensors = "real CUDA tensors" if on_cuda else "fake CUDA tensors"
    observed = f"{tensors}: {flagged} of {len(forms)} forms named ({', '.join(wrong) or 'all as expected'})"
    if on_cuda:
        observed += "; raw captures: " + ", ".join(f"{k}: {v}" for k, v in result["raw_capture"].items())
    return {"ok": not wrong and raw_ok, "observed": observed, **result}


def _syncs(fn) -> str:
    try:
        with sync_debug_errors(True):
            fn()
    except CaptureUnsafeError:
        return "sync"
    except Exception as exc:
        return f"error {type(exc).__name__}"
    return "no sync"


def _raw_captures(forms: dict, device: str) -> dict:
    """Capture each form with no preflight: CUDA must refuse the illegal ones, and the next capture work."""
    backend, out = get_backend("cuda", device), {}
    x = torch.randn(8, device=device)
    for name, (fn, want) in forms.items():

        def forward(fn=fn):
            result = fn()
            return result if isinstance(result, torch.Tensor) and result.device.type == "cuda" else x * 2

        try:
            graph = backend.capture(forward, {}, name=name)
            same = want is None and torch.equal(graph.replay(), forward())
            out[name] = "captured, equals eager" if same else "captured (should not have been)"
        except Exception as exc:
            good = backend.capture(lambda: x + 1, {}, name="next")
            works = torch.equal(good.replay(), x + 1)
            how = "refused by torch" if "torch refused" in str(exc) else "invalidated"  # a pageable copy: torch 2.11
            out[name] = f"{how}, next capture works" if works else f"{type(exc).__name__}, next capture broken"
    backend.reset()
    return out


def compiled(device: str, quick: bool) -> dict:
    runs: list[str] = []

    def counting(gm, example_inputs):
        def run(*args):
            runs.append("run")
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    w = torch.randn(256, 256, device=device)
    x = torch.randn(64, 256, device=device)
    fn = torch.compile(lambda x: torch.relu(x @ w) * 2 + 1, backend=counting)
    backend = get_backend("auto", device)
    backend.warmup(lambda: fn(x), num_warmups=1)
    before = len(runs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = backend.capture(lambda: fn(x), {}, name="compiled")
    ran_compiled = len(runs) - before
    warned = any("without torch.compile" in str(w.message) for w in caught)
    assert_close(graph.replay(), torch.relu(x @ w) * 2 + 1)
    on_cuda = device.startswith("cuda")
    observed = f"{backend.name}: {ran_compiled} compiled run(s) during capture, warning {'given' if warned else 'none'}"
    as_predicted = (ran_compiled == 1 and not warned) if on_cuda else (ran_compiled == 0 and warned)
    backend.reset()
    return {"ok": as_predicted, "observed": observed}


def compiled_inductor(device: str, quick: bool) -> dict:
    """Replay time of a graph captured from inductor-compiled code vs one captured from eager code."""
    if not device.startswith("cuda") or quick:
        return {"ok": True, "observed": "skipped: " + ("--quick" if quick else "no CUDA")}
    torch._dynamo.reset()
    backend = get_backend("cuda", device)
    w, x = torch.randn(1024, 1024, device=device), torch.randn(256, 1024, device=device)

    def f(x):
        return torch.nn.functional.gelu(x @ w) * 2 + torch.tanh(x @ w)

    timings = {}
    for label, fn in (("eager", f), ("inductor", torch.compile(f))):
        backend.warmup(lambda fn=fn: fn(x), num_warmups=2)
        graph = backend.capture(lambda fn=fn: fn(x), {}, name=label)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        end.synchronize()
        timings[label] = round(start.elapsed_time(end) / 200, 4)
    backend.reset()
    observed = f"replay ms per step: eager capture {timings['eager']}, inductor capture {timings['inductor']}"
    return {"ok": True, "observed": observed, "replay_ms": timings}


CASES = {
    "oom_first_key": oom_first_key,
    "invalidated_capture": invalidated_capture,
    "sticky_assert": sticky_assert,
    "preflight_table": preflight_table,
    "compiled": compiled,
    "compiled_inductor": compiled_inductor,
}
