"""gpu_check cases new with the second CUDA review: an NCCL all-reduce captured in a CUDA graph, the founding
bug on CUDA (a stale `query_start_loc` tail), release then capture on one backend, a compiled model through
`CaptureManager`, and bf16 verification tolerances. Each case is `(device, quick) -> dict` with `ok` (as
predicted), `observed` (one line) and its numbers."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from _gpu_steps import tiny_config

from graphcap import CaptureManager, InvariantViolation, StepBatch, check_invariants
from graphcap.backends import get_backend
from graphcap.capture.verification import assert_close
from graphcap.models import build_model
from graphcap.testing import Workload, fill_batch

NO_CUDA = {"ok": True, "observed": "skipped: no CUDA"}


def nccl_graph(device: str, quick: bool) -> dict:
    """A one-GPU NCCL all-reduce (world size 1, a process group made here) captured in a CUDA graph."""
    if not device.startswith("cuda"):
        return NO_CUDA
    import torch.distributed as dist

    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        dist.init_process_group("nccl", init_method=store, rank=0, world_size=1)
        try:
            x = torch.randn(4096, device=device)
            y = torch.empty_like(x)

            def step() -> torch.Tensor:
                y.copy_(x * 2 + 1)
                dist.all_reduce(y)
                return y * 3

            step()  # the communicator is made outside any check, as an engine makes it at start-up
            backend = get_backend("cuda", device)
            backend.warmup(step, num_warmups=2)
            graph = backend.capture(step, {"x": x}, name="all_reduce")
            diffs = []
            for seed in range(3):
                x.copy_(torch.randn(4096, device=device, generator=torch.Generator(device).manual_seed(seed)))
                replayed = graph.replay().clone()
                diffs.append(float((replayed - step()).abs().max()))
            backend.reset()
        finally:
            dist.destroy_process_group()
    ok = max(diffs) == 0.0
    observed = f"all_reduce captured on NCCL {torch.cuda.nccl.version()}; replay vs eager max |diff| {max(diffs):.1e}"
    return {"ok": ok, "observed": observed, "max_abs_diff": max(diffs)}


def _founding_setup(device: str, quick: bool, **overrides) -> tuple[CaptureManager, object, StepBatch]:
    """A captured manager, its mixed key of 8 tokens with the most request rows, and a 2-request batch."""
    config = tiny_config(device, True, **{"capture.sizes": [8], "capture.mode": "full", **overrides})
    manager = CaptureManager(build_model(config), config, progress=False)
    manager.capture()
    key = max((k for k in manager.graphs if k.num_tokens == 8 and not k.uniform), key=lambda k: k.num_reqs)
    batch = StepBatch(np.array([3, 2]), np.array([7, 4]), np.arange(5) % config.model.vocab_size)
    return manager, key, batch


def founding_bug_raw(device: str, quick: bool) -> dict:
    """Replay with the stale tail a dummy run once left: `[0, 3, 5, 0, 0]`, not `[0, 3, 5, 5, 5]`.

    Query lengths go negative and `repeat_interleave(..., output_size=T)` asserts on the device
    (a sticky error: this case runs in its own subprocess on CUDA)."""
    directory = tempfile.mkdtemp(prefix="graphcap-p6-")  # the post-mortem of the crash goes here
    pm = {"report.flight_steps": 2, "report.postmortem": directory, "checks.invariants": "off"}
    manager, key, batch = _founding_setup(device, quick, **pm)
    tails = []

    def stale(inputs, phase) -> None:  # the dummy run's stale tail, after staging filled it (no check: off)
        inputs.host.query_start_loc[inputs.num_reqs + 1 :] = 0
        tails.append(inputs.host.query_start_loc.tolist())

    manager._prepare = stale
    try:
        manager.execute(batch)  # the replay reads the stale tail; the assert surfaces here or at the next step
        manager.execute(batch)
        manager.backend.synchronize()
        what = "no error"
    except RuntimeError as exc:
        what = str(exc).strip().splitlines()[0][:160]
    on_cuda = device.startswith("cuda")
    # CUDA: the kernel asserts on a negative repeat; the CPU kernel refuses the mismatched output size.
    ok = "device-side assert" in what if on_cuda else what != "no error"
    found = _postmortem_of(Path(directory) / "graphcap-postmortem.json")
    observed = f"{manager.last_key} replayed with query_start_loc {tails[0] if tails else None}: {what}; {found}"
    return {
        "ok": ok and found.startswith("post-mortem: "),
        "observed": observed,
        "poisoned": on_cuda and what != "no error",
    }


def _postmortem_of(path: Path) -> str:
    """What the post-mortem a crash left says (re-checked as `graphcap inspect` does), in a few words."""
    from graphcap.postmortem.recheck import load_postmortem, recheck

    if not path.exists():
        return f"no post-mortem at {path}"
    document = load_postmortem(path)
    broken = [c for c in recheck(document) if c.violation is not None]
    if not broken:
        return f"a post-mortem at {path} whose {len(document['steps'])} steps all hold"
    step, v = broken[0].step, broken[0].violation
    return f"post-mortem: {document['error']['phase']} failed, step {step['step']} broke {v.field}[{v.index}]"


def founding_bug_execute(device: str, quick: bool) -> dict:
    """The same batch through `execute` (graphcap fills the tail) equals eager; a corrupted tail is refused."""
    manager, key, batch = _founding_setup(device, quick)
    replayed = manager.execute(batch).clone()
    hit = manager.last_key == key
    expected = manager.eager(batch)
    diff = float((replayed - expected).abs().max())
    assert_close(replayed, expected, **manager.config.checks.tolerance)
    inputs = manager.buffers.stage(batch, key, upload=False)
    tail = inputs.host.query_start_loc
    staged = tail.tolist()
    tail[batch.num_reqs + 1 :] = 0  # corrupt the host rows before they are uploaded
    try:
        check_invariants(inputs, "basic")
        refused = "not refused"
    except InvariantViolation as exc:
        refused = f"refused: {exc.field}[{exc.index}]"
    ok = hit and refused.startswith("refused: query_start_loc")
    observed = (
        f"{key}: staged query_start_loc {staged}, replay == eager (max |diff| {diff:.1e}); a stale tail is {refused}"
    )
    return {"ok": ok, "observed": observed}


def release_recapture(device: str, quick: bool) -> dict:
    """Release the last graph of a pool and capture again on the same backend; two passes of one manager
    with a passed-in backend (the allocator asserts `use_count > 0` on a released pool's handle)."""
    backend = get_backend("auto", device)
    x = torch.randn(1024, device=device)
    backend.warmup(lambda: x * 2, num_warmups=1)
    backend.capture(lambda: x * 2, {}, name="first").release()
    again = backend.capture(lambda: x * 3, {}, name="second")
    same = torch.equal(again.replay(), x * 3)
    backend.reset()
    config = tiny_config(device, quick, **{"capture.sizes": [1, 2, 4], "capture.max_size": 4})
    manager = CaptureManager(build_model(config), config, backend=get_backend("auto", device), progress=False)
    passes, complete = [], []
    for _ in range(2):
        report = manager.capture()
        passes.append(f"{len(report.captured)}/{len(report.records)}")
        complete.append(len(report.captured) == len(report.records) > 0)
    ok = same and all(complete)
    observed = f"{backend.name}: capture after release {'equals eager' if same else 'WRONG'}; passes captured {passes}"
    return {"ok": ok, "observed": observed}


class _Counting:
    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def compiled_model(device: str, quick: bool) -> dict:
    """A compiled submodule (`layers[0].project_qkv`) through `CaptureManager` in full and piecewise modes."""
    on_cuda = device.startswith("cuda")
    seen = {}
    for mode, attention in (("full", "vectorized"), ("piecewise", "per_request")):
        torch._dynamo.reset()
        overrides = {"capture.sizes": [2, 4], "capture.max_size": 4, "capture.mode": mode, "model.attention": attention}
        config = tiny_config(device, True, **overrides)
        model = build_model(config)
        counting = _Counting()
        layer = model.layers[0]
        layer.project_qkv = torch.compile(layer.project_qkv, backend=counting)
        manager = CaptureManager(model, config, progress=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = manager.capture()
        warned = any("without torch.compile" in str(w.message) for w in caught)
        before = counting.runs
        workload = Workload(config, seed=0)
        workload.add_random(8)
        manager.eager(workload.next_batch())
        seen[mode] = {
            "planned": len(report.records),
            "captured": len(report.captured),
            "warned": warned,
            "eager_runs_compiled": counting.runs > before,
            "uncompiled_in_graphs": sorted({f for g in manager.graphs.values() for f in g.uncompiled}),
        }
    # cuda captures the compiled code (no warning); the emulated tape records aten ops (a warning).
    ok = all(
        s["captured"] == s["planned"] and s["eager_runs_compiled"] and s["warned"] != on_cuda for s in seen.values()
    )
    observed = "; ".join(
        f"{mode}: {s['captured']} keys, {'a warning (captured uncompiled)' if s['warned'] else 'captured compiled'}, "
        f"eager steps {'run' if s['eager_runs_compiled'] else 'DO NOT run'} the compiled code"
        for mode, s in seen.items()
    )
    return {"ok": ok, "observed": observed, "modes": seen}


def bf16_tolerance(device: str, quick: bool) -> dict:
    """How a bf16 replay compares with eager: at the real shape (what `verify_probe` does: other GEMM
    kernels) and at the padded shape (the same kernels), elementwise and norm-relative."""
    on_cuda = device.startswith("cuda")
    sizes = [8, 64] if quick else [8, 64, 512]
    overrides = {"model.dtype": "bfloat16", "capture.sizes": sizes, "capture.max_size": sizes[-1]}
    overrides.update({"checks.verify_replay": False, "checks.atol": 0.02, "checks.rtol": 0.02})  # as the 8B config
    if on_cuda and not quick:  # 8B widths and vocabulary, 2 layers: the logits a real model verifies
        overrides.update({"model.hidden_size": 4096, "model.num_heads": 32, "model.num_kv_heads": 8})
        overrides.update({"model.intermediate_size": 14336, "model.vocab_size": 128256, "model.num_layers": 2})
        overrides.update({"batching.max_num_tokens": 512, "capture.max_size": 512})
    config = tiny_config(device, quick, **overrides)
    manager = CaptureManager(build_model(config), config, progress=False)
    manager.capture()
    tol = config.checks.tolerance
    rows = {}
    for key in sorted(manager.graphs, key=lambda k: k.num_tokens):
        if not key.uniform:
            continue
        for label, num_reqs in (("same shape", key.num_reqs), ("real shape", max(1, key.num_reqs * 3 // 4))):
            batch = fill_batch(key, config, key.num_tokens, num_reqs=num_reqs)
            replayed = manager.execute(batch).float().clone()
            expected = manager.eager(batch).float()
            err = (replayed - expected).abs()
            over = int((err > tol["atol"] + tol["rtol"] * expected.abs()).sum())
            relative = float(err.norm() / expected.norm().clamp_min(1e-30))
            rows[f"{key} {label}"] = {"max_abs": float(err.max()), "over_elementwise": over, "norm_relative": relative}
    same_ok = all(r["over_elementwise"] == 0 for k, r in rows.items() if k.endswith("same shape"))
    norm_ok = all(r["norm_relative"] < 1e-2 for r in rows.values())
    worst = max(rows.items(), key=lambda item: item[1]["over_elementwise"])
    observed = (
        f"{len(rows)} comparisons; same shape: {'every element within' if same_ok else 'elements OUTSIDE'} "
        f"atol/rtol {tol['atol']}/{tol['rtol']}; worst {worst[0]}: {worst[1]['over_elementwise']} elements outside, "
        f"norm-relative {worst[1]['norm_relative']:.1e}; all norm-relative < 1e-2: {norm_ok}"
    )
    return {"ok": same_ok and norm_ok, "observed": observed, "comparisons": rows}


CASES = {
    "nccl_graph": nccl_graph,
    "founding_bug_raw": founding_bug_raw,
    "founding_bug_execute": founding_bug_execute,
    "release_recapture": release_recapture,
    "compiled_model": compiled_model,
    "bf16_tolerance": bf16_tolerance,
}
