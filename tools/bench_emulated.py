"""Emulated backend: tape replay vs the eager Python forward of the reference model.

For each size, stage one full batch, capture it with the emulated backend, then time
`model.forward(inputs)` (eager, under inference mode) and `graph.replay()` on the same
staged inputs, interleaved, many times. The target: replay within 1.2x of eager at batch 1,
so CPU test suites that replay graphs stay as fast as eager ones.

    python tools/bench_emulated.py [--sizes 1 8 32 64] [--reps 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from graphcap import PersistentBuffers, load_config
from graphcap.backends import get_backend
from graphcap.keys import KeyRegistry
from graphcap.models import build_model
from graphcap.testing import fill_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 8, 32, 64], help="token counts (uniform decode keys)"
    )
    parser.add_argument("--reps", type=int, default=200, help="timed repetitions per side")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(None, {"device": "cpu", "capture.max_size": max(args.sizes)})
    model = build_model(config)
    buffers = PersistentBuffers.from_config(config)
    backend = get_backend("emulated", "cpu")
    print(f"emulated replay vs eager, reference model (default config), {args.threads} thread(s), {args.reps} reps")
    print(f"{'tokens':>6} {'ops':>5} {'eager us':>9} {'replay us':>9} {'replay/eager':>12}")
    registry = KeyRegistry.from_config(config)
    registry.captured.update(registry.planned)  # dispatch as a captured engine would
    for size in args.sizes:
        # The key a full batch of `size` tokens replays: uniform where one is planned, else mixed.
        key = registry.dispatch(size, min(size, config.batching.max_num_seqs), size <= config.batching.max_num_seqs).key
        inputs = buffers.stage(fill_batch(key, config), key)
        graph = backend.capture(lambda inputs=inputs: model.forward(inputs), inputs.tensors(), name=str(key))
        eager, replay = [], []
        with torch.inference_mode():
            for _ in range(10):
                model.forward(inputs)
                graph.replay()
            for _ in range(args.reps):
                start = time.perf_counter_ns()
                model.forward(inputs)
                middle = time.perf_counter_ns()
                graph.replay()
                end = time.perf_counter_ns()
                eager.append((middle - start) / 1e3)
                replay.append((end - middle) / 1e3)
        e, r = statistics.median(eager), statistics.median(replay)
        num_ops = len(graph.tape.steps)
        print(f"{size:>6} {num_ops:>5} {e:>9.0f} {r:>9.0f} {r / e:>11.2f}x")
        graph.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
