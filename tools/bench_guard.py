"""Per-replay cost of the static-input check (`graphcap.checks.guard.StaticGuard`) at 300 static tensors.

Every replay, at every invariant level, refuses a static tensor that moved since capture. On a
model of 150 `nn.Linear` (300 parameters) with a KV-cache buffer and a staging tensor, this times,
interleaved in one process (rounds of each case, the order rotating), what one replay pays:

- `check_before_replay()`: what must hold before the launch, the tensors the graph may write (the
  KV cache, the staging; not `nn.Parameter`s) and the O(1) flag module hooks set;
- `check_after_replay()`: the parameters (read only), swept while an asynchronous CUDA launch runs;
- `check()`: both, back to back (what a CPU step pays, the emulated replay being synchronous);
- `data_ptr sweep only`: one `Tensor.data_ptr` call per tensor against a list, the whole check of
  graphcap 0.2 (identity, shape and in-place changes unseen): the floor of any per-tensor Python sweep;
- where torch has it (CUDA builds), `torch._C._tensors_data_ptrs_at_indices_equal`, the batched
  address check CUDA graph trees use;
- the walk it once replaced: `named_parameters()` + `named_buffers()` into a dict, then the
  name-by-name `data_ptr` comparison (`CapturedGraph.check_addresses`).

    python tools/bench_guard.py            # 20 rounds x 2000 calls
    python tools/bench_guard.py --quick    # a few rounds, to see that it runs
    python tools/bench_guard.py --baseline ../other/graphcap/checks/guard.py   # beside another guard.py

`--baseline` loads another version of `graphcap/checks/guard.py` (another checkout's) and times its three
checks in the same rounds, on the same model, armed the same way: a change measured before and after in one
process. `check_before_capture()` is what `capture_pending` pays once per call (not per replay).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform

import numpy as np
import torch
from _sampling import measure

from graphcap.checks.guard import StaticGuard

NUM_LINEAR = 150  # 300 parameters (weight and bias each)


class Model(torch.nn.Module):
    """150 `nn.Linear` and a KV-cache buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(NUM_LINEAR)))
        self.register_buffer("kv_cache", torch.zeros(64, 8))


def walk_and_compare(model: torch.nn.Module, recorded: dict[str, int]) -> None:
    """What a replay paid before the guard: rebuild the name -> tensor map, compare by name."""
    tensors = {f"model.{n}": t for n, t in model.named_parameters()}
    tensors.update({f"model.{n}": t for n, t in model.named_buffers()})
    for name, ptr in recorded.items():
        if tensors[name].data_ptr() != ptr:
            raise AssertionError(name)


def cases(model: Model, guard: StaticGuard, statics: dict[str, torch.Tensor]) -> dict[str, object]:
    tensors = list(statics.values())
    ptrs = [t.data_ptr() for t in tensors]
    data_ptr = torch.Tensor.data_ptr
    recorded = {name: t.data_ptr() for name, t in statics.items() if name.startswith("model.")}
    timed = {
        "check_before_replay()": guard.check_before_replay,
        "check_after_replay()": guard.check_after_replay,
        "check() (both)": guard.check,
        "data_ptr sweep only": lambda: list(map(data_ptr, tensors)) != ptrs,
    }
    batched = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if batched is not None:
        indices = list(range(len(tensors)))
        timed["_tensors_data_ptrs_at_indices_equal"] = lambda: batched(tensors, ptrs, indices)
    timed["walk named_parameters + compare"] = lambda: walk_and_compare(model, recorded)
    return timed


GUARD_GOAL_US = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 100 calls (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per case")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per case and round")
    parser.add_argument("--baseline", help="another guard.py, timed beside this one (a before/after comparison)")
    args = parser.parse_args(argv)
    rounds, calls = (3, 100) if args.quick else (args.rounds, args.calls)
    torch.set_num_threads(1)
    model = Model()
    staging = {"packed": torch.zeros(4096, dtype=torch.uint8)}
    guard = StaticGuard()
    statics = guard.collect(model, staging)
    guard.arm(model, staging)
    timed = cases(model, guard, statics)
    timed["check_before_capture() (per capture_pending)"] = lambda: guard.check_before_capture("bench", model, staging)
    baseline = None
    if args.baseline:
        baseline = _load_guard(args.baseline).StaticGuard()
        baseline.arm(model, staging)
        timed["baseline check_before_replay()"] = baseline.check_before_replay
        timed["baseline check_after_replay()"] = baseline.check_after_replay
        timed["baseline check() (both)"] = baseline.check
    names = list(timed)
    samples: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for round_ in range(rounds):
        for j in range(len(names)):
            name = names[(round_ + j) % len(names)]
            samples[name].append(measure(timed[name], calls, warmup=calls // 10))
    print(f"# bench_guard: torch {torch.__version__}, python {platform.python_version()}, 1 thread")
    print(
        f"# {len(statics)} static tensors ({sum(1 for _ in model.parameters())} parameters); "
        f"{rounds} interleaved rounds x {calls} calls per case"
    )
    header = f"{'per replay':<46} {'median':>9} {'p10':>8} {'p90':>8} {'round medians min-max':>23}"
    print(header)
    print("-" * len(header))
    for name, parts in samples.items():
        joined = np.concatenate(parts)
        per_round = [np.median(p) for p in parts]
        print(
            f"{name:<46} {np.median(joined):>7.2f}us {np.percentile(joined, 10):>6.2f}us "
            f"{np.percentile(joined, 90):>6.2f}us {min(per_round):>10.2f}-{max(per_round):.2f}us"
        )
    before = np.median(np.concatenate(samples["check_before_replay()"]))
    sweep = np.median(np.concatenate(samples["data_ptr sweep only"]))
    whole = np.median(np.concatenate(samples["check() (both)"]))
    print(
        f"goal: what a replay waits for before its launch <= {GUARD_GOAL_US:g} us: "
        f"check_before_replay() {before:.2f} us; the whole check is {whole / sweep:.2f}x the bare data_ptr sweep "
        "(it runs after the launch, overlapping the graph on CUDA)"
    )
    if baseline is not None:
        for name in ("check_before_replay()", "check_after_replay()", "check() (both)"):
            now, then = (np.median(np.concatenate(samples[n])) for n in (name, f"baseline {name}"))
            print(f"vs baseline: {name} {now:.2f} us here, {then:.2f} us baseline ({now / then:.2f}x)")
        baseline.disarm()
    guard.disarm()
    return 0


def _load_guard(path: str):
    """Another version of `graphcap/checks/guard.py`, as its own module (it imports the installed graphcap)."""
    spec = importlib.util.spec_from_file_location("baseline_guard", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    raise SystemExit(main())
