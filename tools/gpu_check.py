"""End-to-end check on a GPU machine (or the CPU with the emulated backend), in a few minutes.

1. The embedded default config (tiny reference model): capture every key, verify each
   replay against eager, time eager vs replay per key.
2. With CUDA and enough free memory: the same for a Llama-3-8B-shaped model with random
   bf16 weights (`capture_configs/llama3-8b-h200.yaml`).
3. The capture-unsafe preflight (an `.item()` in the forward is named before
   capture) and the address check (a replaced KV cache is refused at replay).

Prints a table per model and writes every number as JSON (`--out`).

    python tools/gpu_check.py                     # best device, JSON to gpu_check.json
    python tools/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from graphcap import CaptureManager, CaptureUnsafeError, load_config
from graphcap.backends import StaticInputMovedError, resolve_device
from graphcap.models import build_model
from graphcap.report import atomic_write, format_bytes
from graphcap.testing import fill_batch, time_key

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = ROOT / "capture_configs" / "llama3-8b-h200.yaml"
LLAMA_8B_MIN_FREE = 60 * 2**30  # weights 16 GiB + KV 16 GiB + activations and graph pool


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--out", default="gpu_check.json", help="JSON results (default gpu_check.json)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per key and side (default 20)")
    parser.add_argument("--quick", action="store_true", help="small schedule, few steps (a smoke run)")
    parser.add_argument("--skip-8b", action="store_true", help="skip the Llama-3-8B-shaped model")
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": _environment()}
    print(f"# environment: {results['environment']}", flush=True)

    overrides = {"device": args.device, "checks.invariants": "full"}
    if args.quick:
        overrides["capture.max_size"] = 8
    results["tiny"] = check_model("tiny reference model (embedded default config)", None, overrides, steps)

    if resolve_device(load_config(None, {"device": args.device})).type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if args.skip_8b or args.quick:
            results["llama3_8b"] = {"skipped": "--skip-8b or --quick"}
        elif free < LLAMA_8B_MIN_FREE:
            results["llama3_8b"] = {"skipped": f"{format_bytes(free)} free, needs {format_bytes(LLAMA_8B_MIN_FREE)}"}
        else:
            # ~100 keys at ~50 ms a forward: 5 timed steps a side keep the run near 5 minutes.
            results["llama3_8b"] = check_model(
                "Llama-3-8B-shaped, random bf16 weights",
                LLAMA_8B,
                {"device": args.device, "report.path": None},
                min(steps, 5),
            )
    else:
        results["llama3_8b"] = {"skipped": "no CUDA device"}
    if "skipped" in results["llama3_8b"]:
        print(f"\nllama3_8b: skipped ({results['llama3_8b']['skipped']})")
    results["safety"] = check_safety(overrides)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    atomic_write(Path(args.out), json.dumps(results, indent=2) + "\n")
    print(f"\nresults written to {args.out}")
    ok = all(r.get("all_verified", True) for r in results.values() if isinstance(r, dict))
    ok = ok and results.get("safety", {}).get("ok", True)
    print("gpu_check: ok" if ok else "gpu_check: FAILED")
    return 0 if ok else 1


def check_model(title: str, path, overrides: dict, steps: int) -> dict:
    """Capture, verify and time one config; print its table; return the numbers."""
    config = load_config(path, overrides)
    started = time.perf_counter()
    model = build_model(config)
    build_seconds = time.perf_counter() - started
    manager = CaptureManager(model, config, progress=False)
    report = manager.capture()
    rows = []
    for record in report.captured:
        timing = time_key(manager, record.key, steps=steps)
        rows.append(
            {
                **record.to_dict(),
                "eager_ms": None if timing is None else timing.eager_ms,
                "replay_ms": None if timing is None else timing.replay_ms,
                "speedup": None if timing is None else timing.speedup,
            }
        )
    print(f"\n## {title}: {len(report.captured)} graphs on {report.device} ({report.backend} backend)")
    print(
        f"{'key':<8} {'size':>5} {'reqs':>5} {'capture ms':>10} {'graph mem':>10} "
        f"{'eager ms':>9} {'replay ms':>9} {'speedup':>8}"
    )
    for row in rows:
        key = row["key"]
        timed = row["eager_ms"] is not None
        print(
            f"{'uniform' if key['uniform'] else 'mixed':<8} {key['num_tokens']:>5} {key['num_reqs']:>5} "
            f"{row['capture_seconds'] * 1e3:>10.1f} {format_bytes(row['memory_bytes']):>10} "
            + (
                f"{row['eager_ms']:>9.3f} {row['replay_ms']:>9.3f} {row['speedup']:>7.2f}x"
                if timed
                else f"{'(a 1-token step is always uniform)':>28}"
            )
        )
    print(
        f"total capture time {report.total_seconds:.2f} s; pool memory {format_bytes(report.pool_bytes)} "
        f"vs largest single graph {format_bytes(report.largest_graph_bytes)}; model build {build_seconds:.1f} s"
    )
    all_verified = all(r.verified for r in report.captured) and not report.skipped
    return {
        "title": title,
        "device": report.device,
        "backend": report.backend,
        "total_capture_seconds": report.total_seconds,
        "pool_bytes": report.pool_bytes,
        "largest_graph_bytes": report.largest_graph_bytes,
        "skipped": [r.to_dict() for r in report.skipped],
        "all_verified": all_verified,
        "graphs": rows,
    }


def check_safety(overrides: dict) -> dict:
    """The unsafe-op check (CUDA: preflight in warmup; CPU: emulated capture) names `.item()`;
    a replaced KV cache is refused."""
    config = load_config(None, {**overrides, "capture.max_size": 2})
    model = build_model(config)
    forward = model.forward
    out: dict = {}

    def item_forward(inputs):
        logits = forward(inputs)
        return logits * float(logits.sum().item() > 0)

    model.forward = item_forward
    try:
        CaptureManager(model, config, progress=False).capture()
        out["unsafe_named"] = False
    except CaptureUnsafeError as exc:
        out["unsafe_named"] = "item" in str(exc)
    except Exception as exc:  # report what happened instead of the preflight's error
        out["unsafe_named"] = f"{type(exc).__name__}: {exc}"[:300]
    model.forward = forward
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    key = next(iter(manager.graphs))
    model.kv_cache = torch.zeros_like(model.kv_cache)  # a buffer replaced after capture
    try:
        manager.execute(fill_batch(key, config))
        out["moved_refused"] = False
    except StaticInputMovedError as exc:
        out["moved_refused"] = "kv_cache" in str(exc)
    out["ok"] = out["unsafe_named"] is True and out["moved_refused"] is True
    print(
        f"\nsafety: unsafe op named before capture: {out['unsafe_named']}; "
        f"replaced KV cache refused: {out['moved_refused']}"
    )
    return out


def _environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory=format_bytes(props.total_memory), cuda=torch.version.cuda)
    return env


if __name__ == "__main__":
    sys.exit(main())
