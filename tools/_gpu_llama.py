"""gpu_check cases at Llama-3-8B shapes: the whole capture pass of graphcap/configs/llama3-8b-h200.yaml (per-key
seconds, the graph pool measured from the allocator's own segments beside the estimate), and piecewise vs full
vs eager at decode sizes. Each case is `(device, quick) -> dict` with `ok`, `observed` and its numbers."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from _gpu_report import checkpoint

from graphcap import CaptureManager, load_config
from graphcap.backends import get_backend
from graphcap.config.byte_counts import format_bytes
from graphcap.memory.estimate import estimate_memory
from graphcap.models import build_model
from graphcap.testing import fill_batch, time_key

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = ROOT / "graphcap" / "configs" / "llama3-8b-h200.yaml"
LLAMA_8B_MIN_FREE = 60 * 2**30  # weights 16 GiB + KV 16 GiB + activations and graph pool
PLANNED_KEYS = 103
DECODE_SIZES = [1, 8, 32, 128]


def _skip(device: str, quick: bool) -> dict | None:
    if not device.startswith("cuda"):
        return {"ok": True, "observed": "skipped: no CUDA"}
    free = torch.cuda.mem_get_info(device)[0]
    if quick or free < LLAMA_8B_MIN_FREE:
        why = "--quick" if quick else f"{format_bytes(free)} free, needs {format_bytes(LLAMA_8B_MIN_FREE)}"
        return {"ok": True, "observed": f"skipped: {why}"}
    return None


class KeyTimes:
    """Seconds per key of each capture step: preflight, plain warmups, capture (+ instantiate), verification.

    Wraps the backend's `warmup`/`capture`, the preflight it enters and the manager's verification
    for the pass (private hooks: a measuring tool, not an API); each step ends with a device sync.
    """

    def __init__(self, manager: CaptureManager, figures=None) -> None:
        self.manager = manager
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._key = "?"
        self.figures = figures
        """() -> dict saved with the per-key seconds as each key starts (the pool against the estimate)."""

    @contextlib.contextmanager
    def installed(self):
        import graphcap.backends.base as base

        backend = self.manager.backend
        original_preflight = base.preflight

        @contextlib.contextmanager
        def preflight(device, **options):
            with self._timed("preflight"), original_preflight(device, **options) as uncompiled:
                yield uncompiled

        # Methods of the capture stages, wrapped only where they exist (a renamed one loses its column, never
        # the case): `Recorder.record(key)` per key, then the two verifications per key.
        from graphcap.capture.recorder import Recorder
        from graphcap.capture.verifier import Verifier

        hooks = [(Recorder, "record", None), (Verifier, "dummy", "verification"), (Verifier, "fills", "verification")]
        patched = {
            (cls, name): self._around(getattr(cls, name), step, key_from_arg=True)
            for cls, name, step in hooks
            if callable(getattr(cls, name, None))
        }
        originals = {(cls, name): getattr(cls, name) for cls, name in patched}
        base.preflight = preflight
        for (cls, name), fn in patched.items():
            setattr(cls, name, fn)
        backend.warmup = self._around(backend.warmup, "warmups")
        backend.capture = self._around(backend.capture, "capture")
        backend.capture_pieces = self._around(backend.capture_pieces, "capture")
        try:
            yield self
        finally:
            base.preflight = original_preflight
            for (cls, name), fn in originals.items():
                setattr(cls, name, fn)
            for name in ("warmup", "capture", "capture_pieces"):
                vars(backend).pop(name, None)

    @contextlib.contextmanager
    def _timed(self, step: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.manager.backend.synchronize()  # the device work, not the launches
            self.seconds[self._key][step] += time.perf_counter() - start

    def _around(self, fn, step: str | None, key_from_arg: bool = False):
        def timed(*args, **kwargs):
            if key_from_arg:  # a capture stage's method: (self, key, ...)
                self._key = str(args[1])
                figures = self.figures() if self.figures is not None else {}
                checkpoint({"seconds_per_key": self.table(), **figures})  # a pass cut short keeps the keys it did
            if step is None:
                return fn(*args, **kwargs)
            with self._timed(step):
                return fn(*args, **kwargs)

        return timed

    def table(self) -> dict[str, dict[str, float]]:
        """Per key: seconds of each step, warmups net of the preflight they include."""
        rows = {}
        for key, steps in self.seconds.items():
            row = {step: round(value, 3) for step, value in steps.items()}
            row["warmups"] = round(steps.get("warmups", 0.0) - steps.get("preflight", 0.0), 3)
            rows[key] = row
        return rows


def pool_segments(handles) -> dict:
    """Bytes of the allocator's segments that belong to the given graph pools (`memory_snapshot`)."""
    wanted = {tuple(h) for h in handles if h is not None}
    reserved = allocated = count = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) in wanted:
            count += 1
            reserved += segment["total_size"]
            allocated += segment.get("allocated_size", 0)
    return {"segments": count, "reserved_bytes": reserved, "allocated_bytes": allocated}


def pool_figures(pool: dict, estimated_graphs: int) -> dict:
    """The graph pool so far against the estimate's graphs: what P3 saves after every key."""
    return {"pool": pool, "pool_vs_estimate": round(pool["reserved_bytes"] / max(1, estimated_graphs), 3)}


def _handles(manager: CaptureManager) -> set:
    handles = {getattr(graph, "pool_handle", None) for graph in manager.graphs.values()}
    return {h for h in handles if h is not None} | {manager.backend.pool.handle}


def llama8b(device: str, quick: bool) -> dict:
    skipped = _skip(device, quick)
    if skipped is not None:
        return skipped
    config = load_config(LLAMA_8B, {"device": device, "report.path": None})
    estimate = estimate_memory(config, backend="cuda")
    started = time.perf_counter()
    model = build_model(config)
    build_s = time.perf_counter() - started
    manager = CaptureManager(model, config, progress=False)
    torch.cuda.reset_peak_memory_stats(device)
    reserved_before = torch.cuda.memory_reserved(device)
    times = KeyTimes(manager, lambda: pool_figures(pool_segments(_handles(manager)), estimate.parts["graphs"]))
    with times.installed():
        report = manager.capture()
    pool = pool_segments(_handles(manager))
    figures = pool_figures(pool, estimate.parts["graphs"])
    checkpoint({"seconds_per_key": times.table(), **figures, "captured": len(report.captured)})
    timed = {}
    for key in manager.graphs:
        if key.num_tokens in (1, 8, 32, 128, 256, 512):
            wall = time_key(manager, key, steps=5)
            if wall is not None:
                timed[str(key)] = {"eager_ms": wall.eager_ms, "replay_ms": wall.replay_ms, **_event_ms(manager, key)}
    speed = {k: round(v["eager_ms"] / v["replay_ms"], 2) for k, v in sorted(timed.items())}
    per_key = times.table()
    totals = {step: round(sum(row.get(step, 0.0) for row in per_key.values()), 1) for step in _STEPS}
    ratio = pool["reserved_bytes"] / max(1, estimate.parts["graphs"])
    observed = (
        f"{len(report.captured)} of {len(report.records)} keys in {report.total_seconds:.0f} s (build {build_s:.0f} s;"
        f" seconds over all keys {totals}); graph pool {format_bytes(pool['reserved_bytes'])} in "
        f"{pool['segments']} segments (estimate {format_bytes(estimate.parts['graphs'])}, x{ratio:.2f}); "
        f"reserved grew {format_bytes(torch.cuda.memory_reserved(device) - reserved_before)} (with the warmups' "
        f"cache); peak allocated {format_bytes(torch.cuda.max_memory_allocated(device))}; wall speedup {speed}"
    )
    ok = len(report.records) == PLANNED_KEYS and not report.skipped and 0.5 <= ratio <= 2.0
    return {
        "ok": ok,
        "observed": observed,
        "pool": pool,
        "estimate": estimate.to_dict(),
        "seconds_per_key": per_key,
        "seconds_total": totals,
        "report": {k: v for k, v in report.to_dict().items() if k != "config"},
        "timed": timed,
    }


_STEPS = ("preflight", "warmups", "capture", "verification")


def llama8b_piecewise(device: str, quick: bool) -> dict:
    """Decode keys of the 8B model captured full, then piecewise around per-request attention, on one
    backend: replay ms of each beside eager, and the memory a piecewise pass leaves allocated."""
    skipped = _skip(device, quick)
    if skipped is not None:
        return skipped
    base = {"device": device, "report.path": None, "capture.sizes": DECODE_SIZES, "capture.on_error": "raise"}
    full = load_config(LLAMA_8B, base)
    piecewise = load_config(LLAMA_8B, {**base, "capture.mode": "piecewise", "model.attention": "per_request"})
    model = build_model(full)
    backend = get_backend("cuda", device)  # one side stream: its library workspaces exist for both passes
    rows = defaultdict(dict)
    manager = CaptureManager(model, full, backend=backend, progress=False)
    manager.capture()
    for key in manager.graphs:
        if key.uniform:
            rows[key.num_tokens].update(_step_ms(manager, key, "full"))
    manager.reset()
    model.attention = "per_request"
    manager = CaptureManager(model, piecewise, backend=backend, progress=False)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(device)
    report = manager.capture()
    torch.cuda.synchronize()
    left_allocated = torch.cuda.memory_allocated(device) - allocated
    for key in manager.graphs:
        rows[key.num_tokens].update(_step_ms(manager, key, "piecewise"))
    pool = pool_segments(_handles(manager))
    before_fix = sum(DECODE_SIZES) * _pinned_per_token(full)
    shown = {t: {k: round(v, 3) for k, v in r.items()} for t, r in sorted(rows.items())}
    observed = (
        f"{len(report.captured)} piecewise keys; ms per decode step {shown}; a piecewise pass left "
        f"{format_bytes(left_allocated)} allocated (eager ops pinning their tensors would leave "
        f"~{format_bytes(before_fix)}); graph pool {format_bytes(pool['reserved_bytes'])}"
    )
    ok = not report.skipped and left_allocated < before_fix / 4
    return {"ok": ok, "observed": observed, "ms": shown, "left_allocated": left_allocated, "pool": pool}


def _pinned_per_token(config) -> int:
    """Bytes per token an eager op's tensors took when each graph kept them: q, k, the qkv storage, out."""
    m = config.model
    per_layer = (3 * m.num_heads + 3 * m.num_kv_heads) * m.head_dim
    return per_layer * m.num_layers * 2  # bf16


def _step_ms(manager: CaptureManager, key, label: str) -> dict:
    timing = time_key(manager, key, steps=5, warmup=2)
    if timing is None:
        return {}
    return {f"{label}_replay_ms": timing.replay_ms, f"{label}_eager_ms": timing.eager_ms}


def _event_ms(manager: CaptureManager, key) -> dict:
    """GPU time per step (CUDA events around the step; the host runs ahead between them)."""
    batch = fill_batch(key, manager.config)
    out = {}
    with manager.uncounted():
        for side, step in (("eager_gpu_ms", manager.eager), ("replay_gpu_ms", manager.execute)):
            samples = []
            for _ in range(6):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(batch)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            out[side] = statistics.median(samples[1:])
    return out


CASES = {"llama8b": llama8b, "llama8b_piecewise": llama8b_piecewise}
