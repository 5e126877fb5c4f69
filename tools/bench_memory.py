"""Memory estimate vs reality: `graphcap.memory.estimate.estimate_memory` against a real capture on the CPU.

For each config, fresh processes build the model and capture it (emulated backend) and report:

- `alloc peak`: the most bytes of torch CPU tensor storage alive at once from the build to the
  end of capture, exact (`graphcap.testing.allocations.allocation_peak`: the profiler's
  allocation events, summed in time order). This is what the estimate predicts.
- `RSS growth`: the growth of peak resident memory (`VmHWM` over `VmRSS` before the build; a
  tiny capture first pays the one-time costs), in another process without the profiler. Noisy:
  the C allocator keeps and reuses freed pages, and Python objects count too.

Each is measured `--runs` times (median, then min-max); `est/alloc` is the estimate over the
median allocation peak (goal: 1.00 to 1.10, never below 1).

    python tools/bench_memory.py            # three configs, 60 MiB to 1.1 GiB, 3 runs each
    python tools/bench_memory.py --quick    # the default config, one run (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from graphcap import load_config
from graphcap.config.byte_counts import format_bytes
from graphcap.memory.estimate import estimate_memory

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "default (fp32, 2 layers, sizes to 64)": {},
    "bf16, 4096 blocks, max_model_len 2048": {
        **{"model.hidden_size": 512, "model.dtype": "bfloat16", "kv_cache.num_blocks": 4096},
        **{"kv_cache.max_model_len": 2048, "capture.max_size": 64},
    },
    "1024 wide, 4 layers, vocab 32000, sizes to 128": {
        **{"model.hidden_size": 1024, "model.num_heads": 16, "model.num_kv_heads": 4, "model.num_layers": 4},
        **{"capture.max_size": 128, "batching.max_num_tokens": 512, "model.vocab_size": 32000},
    },
}

_PROBE = """
import json, sys
from graphcap import CaptureManager, load_config
from graphcap.models import build_model
def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
overrides, exact = json.loads(sys.argv[1]), sys.argv[2] == "exact"
warm = load_config(overrides={"device": "cpu", "capture.max_size": 1})
CaptureManager(build_model(warm), warm, progress=False).capture()
del warm
config = load_config(overrides={"device": "cpu", **overrides})
def capture():
    CaptureManager(build_model(config), config, progress=False).capture()
if exact:
    from graphcap.testing.allocations import allocation_peak
    print(json.dumps(allocation_peak(capture).peak))
else:
    base = status("VmRSS:")
    capture()
    print(json.dumps(status("VmHWM:") - base))
"""


def measure(overrides: dict, what: str) -> int:
    """One fresh process: `exact` (the allocation peak) or `rss` (peak RSS growth), in bytes."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(overrides), what], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"the {what} probe failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[int]) -> str:
    """`median (min-max)` in MiB."""
    mib = [v / 2**20 for v in values]
    return f"{statistics.median(mib):.2f} ({min(mib):.2f}-{max(mib):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first config, one run")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per config and measure (default 3)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1")
    if not Path("/proc/self/status").exists():
        print("needs /proc/self/status (Linux)", file=sys.stderr)
        return 2
    configs = list(CONFIGS.items())[: 1 if args.quick else None]
    runs = 1 if args.quick else args.runs
    header = f"{'config':<48} {'estimate':>10} {'alloc peak MiB':>22} {'est/alloc':>9} {'RSS growth MiB':>22}"
    print(header)
    for name, overrides in configs:
        estimate = estimate_memory(load_config(overrides={"device": "cpu", **overrides})).total
        exact = [measure(overrides, "exact") for _ in range(runs)]
        rss = [measure(overrides, "rss") for _ in range(runs)]
        print(
            f"{name:<48} {format_bytes(estimate):>10} {spread(exact):>22} "
            f"{estimate / statistics.median(exact):>9.4f} {spread(rss):>22}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
