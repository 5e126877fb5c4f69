"""Memory estimate vs reality: `graphcap.memory.estimate_memory` against a real capture's peak RSS.

For each config, a fresh process captures it on the CPU (emulated backend) and reports the
growth of its peak resident memory (`VmHWM` over `VmRSS` before building the model; a tiny
capture first pays the one-time costs). Printed beside it: the estimate, its parts, and what
the capture report calls graph memory (a sum of per-graph peaks, not a process peak).

    python tools/bench_memory.py            # three configs, 20 MiB to 1.2 GiB
    python tools/bench_memory.py --quick    # one small config (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from graphcap import load_config
from graphcap.memory import estimate_memory
from graphcap.report import format_bytes

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
overrides = json.loads(sys.argv[1])
warm = load_config(overrides={"device": "cpu", "capture.max_size": 1})
CaptureManager(build_model(warm), warm, progress=False).capture()
del warm
base = status("VmRSS:")
config = load_config(overrides={"device": "cpu", **overrides})
report = CaptureManager(build_model(config), config, progress=False).capture()
print(json.dumps({"peak": status("VmHWM:") - base, "pool": report.pool_bytes}))
"""


def measure(overrides: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(overrides)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first config only")
    args = parser.parse_args()
    if not Path("/proc/self/status").exists():
        print("needs /proc/self/status (Linux)", file=sys.stderr)
        return 2
    configs = list(CONFIGS.items())[: 1 if args.quick else None]
    print(f"{'config':<48} {'estimate':>10} {'peak RSS':>10} {'peak/est':>8} {'report pool':>11}")
    for name, overrides in configs:
        estimate = estimate_memory(load_config(overrides={"device": "cpu", **overrides}))
        real = measure(overrides)
        print(
            f"{name:<48} {format_bytes(estimate.total):>10} {format_bytes(real['peak']):>10} "
            f"{real['peak'] / estimate.total:>8.2f} {format_bytes(real['pool']):>11}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
