"""Per-step host cost of `CaptureManager.execute` around the replay, at one token.

What a replayed step pays on the host besides the graph itself: dispatch, staging and the
invariants, the static guard, the step bookkeeping and the output cut. The model is `Trivial`:
two ops (an embedding lookup and a KV-cache write) over `--params` parameters, so the replay
costs a few microseconds and the difference is the host path, not noise from a long replay. The
config is `graphcap.testing.TINY` at `capture.sizes: [1, 2]`, `checks.invariants` as given. This
times, interleaved in one process (rounds of `--calls` calls of each case, the order rotating
every round):

- `execute`: `manager.execute(batch)`, a one-request decode step naming the persistent block table;
- `execute, no replay`: the same step on a second manager whose graphs' own work (`_replay`) does
  nothing: the whole host path of a replayed step, without the replay's torch ops competing with it
  for the caches (which makes `execute - replay` overstate it);
- `replay`: the bare `graph.replay()` of the key that step dispatches to;
- the parts, each alone: `dispatch` (`KeyRegistry.dispatch`), `stage` (the manager's staging path:
  stage, prepare, invariants, upload), `guard` (the static guard before and after a replay), `cut`
  (the output cut to its real rows); `dispatch, 1 axis`: the same dispatch with a key axis
  (`capture.axes: {lora: [0, 1, 2, 4, 8]}`, a step of 3 adapters padded to 4).

"execute - replay" is each round's median `execute` minus its median `replay`; the table shows
the median of those differences and their p10-p90 over rounds (the rounds see the machine's
drift alike).

    python tools/bench_execute.py              # 30 rounds x 300 calls
    python tools/bench_execute.py --quick      # a few rounds, to see that it runs
    python tools/bench_execute.py --invariants full
    python tools/bench_execute.py --baseline 90df583   # beside another revision, in this process

`--mode MODE` times every case a second time inside an engine's torch function mode, in the same rounds:
`default-device` (`torch.set_default_device` to the manager's device, as nano-vllm leaves on for the whole
process), `device` (a `torch.device(...)` context manager, as vLLM and SGLang use) or `function-mode` (a
`TorchFunctionMode` that only forwards each call); it then prints each case's median per-round ratio (under the
mode over without it) with its p10-p90, beside the goal: the host path within 1.2x of the same step without it.

    python tools/bench_execute.py --mode default-device

`--baseline REV` imports graphcap as of git revision REV beside this checkout's (`_baseline.py`:
the package renamed `graphcap_base`), builds the same cases on it, and times the two versions'
cases alternately in every round; it then prints each case's median per-round ratio (this tree
over REV) with its p10-p90. A case the older version cannot build (a key axis before axes
existed) is timed on this tree only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import platform
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import torch
from _sampling import measure
from torch.overrides import TorchFunctionMode

import graphcap


class Trivial(torch.nn.Module):
    """An embedding read and a KV-cache write, beside `num_params - 1` weights it holds (all guarded)."""

    def __init__(self, vocab_size: int, num_slots: int, num_params: int) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(vocab_size, 8), requires_grad=False)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(8), requires_grad=False) for _ in range(num_params - 1)
        )
        self.register_buffer("kv_cache", torch.zeros(num_slots))

    def forward(self, inputs) -> torch.Tensor:
        hidden = self.embed.index_select(0, inputs.input_ids.long())  # [T, 8]
        self.kv_cache.index_copy_(0, inputs.slot_mapping.long().clamp(min=0), hidden[:, 0])
        return hidden


def build(pkg: ModuleType, invariants: str, num_params: int) -> tuple[object, object]:
    """A captured manager of `Trivial` at sizes 1 and 2 (graphcap package `pkg`), and a one-token decode step."""
    tiny = importlib.import_module(f"{pkg.__name__}.testing").TINY
    config = pkg.load_config(overrides={**tiny, "capture.sizes": [1, 2], "checks.invariants": invariants})
    slots = config.kv_cache.num_blocks * config.kv_cache.block_size
    manager = pkg.CaptureManager(Trivial(config.model.vocab_size, slots, num_params), config, progress=False)
    manager.capture()
    manager.block_table.set_row(0, [1])
    batch = pkg.StepBatch(np.ones(1, np.int32), np.array([3], np.int32), np.array([5], np.int32), manager.block_table)
    return manager, batch


def cases(pkg: ModuleType, manager, batch) -> dict[str, object]:
    """The timed callables of package `pkg`: the whole step, the bare replay and each part alone."""
    execute = manager.execute
    key = manager.dispatch(batch)
    graph = manager.graphs[key]
    registry = manager.registry
    guard = manager._guard
    before = getattr(guard, "check_before_replay", guard.check)  # the guard of main had one check
    after = getattr(guard, "check_after_replay", lambda: None)
    output = graph.replay()
    n, uniform = batch.num_tokens, batch.is_uniform(registry.uniform_query_len)
    inputs = manager._stage(batch, key, phase="replay")
    outputs = getattr(manager, "_outputs", None)
    if outputs is not None:
        cut = lambda: outputs.real(output, inputs)  # noqa: E731
    else:  # graphcap before `OutputRows` cut outputs with a function
        real_rows = importlib.import_module(f"{pkg.__name__}.outputs").real_rows
        cut = lambda: real_rows(output, n, key.num_tokens)  # noqa: E731

    def stage() -> None:
        manager._stage(batch, key, phase="replay")

    registry_type = type(registry)
    sizes, q, rows = registry.sizes, registry.uniform_query_len, registry.max_num_seqs
    try:
        with_axis = registry_type(sizes, registry.mode, q, rows, None, axes={"lora": (0, 1, 2, 4, 8)})
    except TypeError:  # a version before key axes
        with_axis = None
    else:
        for planned in with_axis.planned:
            with_axis.mark_captured(planned)
    step_axes = {"lora": 3}

    def guarded() -> None:
        before()
        after()

    hollow, hollow_batch = build(pkg, manager.config.checks.invariants, len(list(manager.model.parameters())))
    for captured in hollow.graphs.values():
        captured._replay = lambda: None  # the graph's own work gone: what stays is the host path

    timed = {
        "execute": lambda: execute(batch),
        "execute, no replay": lambda: hollow.execute(hollow_batch),
        "replay": graph.replay,
        "dispatch": lambda: registry.dispatch(n, n, uniform),
        "dispatch, 1 axis": lambda: with_axis.dispatch(n, n, uniform, step_axes),
        "stage": stage,
        "guard": guarded,
        "cut": cut,
    }
    if with_axis is None:
        del timed["dispatch, 1 axis"]
    return timed


class Forwarding(TorchFunctionMode):
    """A torch function mode that only forwards each call: the cost of Python dispatch alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def default_device(device: torch.device) -> Iterator[None]:
    """`torch.set_default_device(device)` inside, as an engine leaves it for the whole process."""
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def mode_of(name: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The context of `--mode name`: entered around each timed sample run of a case's mode twin."""
    return {
        "default-device": lambda: default_device(device),
        "device": lambda: torch.device(device),
        "function-mode": Forwarding,
    }[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 50 calls (seconds, for tests)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per case")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per case and round")
    parser.add_argument("--invariants", choices=("off", "basic", "full"), default="basic")
    parser.add_argument("--params", type=int, default=16, help="parameters of the model (all guarded)")
    parser.add_argument("--baseline", metavar="REV", help="a git revision of graphcap timed beside this tree")
    parser.add_argument(
        "--mode",
        choices=("default-device", "device", "function-mode"),
        help="also time every case inside this torch function mode (an engine's), in the same rounds",
    )
    args = parser.parse_args(argv)
    rounds, calls = (3, 50) if args.quick else (args.rounds, args.calls)
    torch.set_num_threads(1)
    manager, batch = build(graphcap, args.invariants, args.params)
    timed = cases(graphcap, manager, batch)
    base = None
    if args.baseline:
        import _baseline

        base = _baseline.load(args.baseline)
        base_manager, base_batch = build(base, args.invariants, args.params)
        timed.update({f"{BASE}{name}": fn for name, fn in cases(base, base_manager, base_batch).items()})
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager]] = dict.fromkeys(timed, contextlib.nullcontext)
    if args.mode:
        enter = mode_of(args.mode, manager.device)
        for name, fn in list(timed.items()):
            timed[f"{MODE}{name}"], contexts[f"{MODE}{name}"] = fn, enter
    names = list(timed)
    medians = {name: np.empty(rounds) for name in names}
    with manager.uncounted():
        for round_ in range(rounds):
            for j in range(len(names)):
                name = names[(round_ + j) % len(names)]
                with contexts[name]():
                    medians[name][round_] = np.median(measure(timed[name], calls, warmup=calls // 10))
    print(f"# bench_execute: torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}")
    print(
        f"# Trivial model, TINY config, invariants {args.invariants}, key {manager.last_key}, "
        f"{args.params} parameters; 1 torch thread"
    )
    print(f"# {rounds} interleaved rounds x {calls} calls per case; medians of the per-round medians")
    header = f"{'per step':<30} {'median':>9} {'p10':>8} {'p90':>8}"
    print(header)
    print("-" * len(header))
    for name in names:
        p10, p50, p90 = np.percentile(medians[name], [10, 50, 90])
        print(f"{name:<30} {p50:>7.2f}us {p10:>6.2f}us {p90:>6.2f}us")
    overhead = medians["execute"] - medians["replay"]
    p10, p50, p90 = np.percentile(overhead, [10, 50, 90])
    print(f"{'execute - replay':<30} {p50:>7.2f}us {p10:>6.2f}us {p90:>6.2f}us")
    parts = sum(np.median(medians[name]) for name in ("dispatch", "stage", "guard", "cut"))
    hollow = np.median(medians["execute, no replay"])
    print(
        f"goal: execute - replay <= {EXECUTE_GOAL_US:g} us: {p50:.1f} us by subtraction; "
        f"execute with the graph's work stubbed out {hollow:.1f} us; graphcap's parts alone (dispatch + stage + "
        f"guard + cut) {parts:.1f} us"
    )
    if args.mode:
        print()
        print(f"under --mode {args.mode} over without it (per-round ratio of the medians; 1: no cost)")
        print(f"{'case':<30} {'median':>7} {'p10':>6} {'p90':>6}")
        ratios = {}
        for name in names:
            if name.startswith(MODE):
                continue
            ratios[name] = np.percentile(medians[f"{MODE}{name}"] / medians[name], [10, 50, 90])
            p10, p50, p90 = ratios[name]
            print(f"{name:<30} {p50:>6.2f}x {p10:>5.2f}x {p90:>5.2f}x")
        p10, p50, p90 = ratios["execute, no replay"]
        print(
            f"goal: the host path under --mode {args.mode} within {MODE_GOAL:g}x of the same step without it: "
            f"{p50:.2f}x ({p10:.2f}-{p90:.2f}x, execute with the graph's work stubbed out); "
            f"execute {ratios['execute'][1]:.2f}x"
        )
    if base is not None:
        print()
        print(f"this tree over {args.baseline} (per-round ratio of the medians; under 1: faster here)")
        print(f"{'case':<30} {'median':>7} {'p10':>6} {'p90':>6}")
        for name in names:
            if name.startswith((BASE, MODE)) or f"{BASE}{name}" not in medians:
                continue
            p10, p50, p90 = np.percentile(medians[name] / medians[f"{BASE}{name}"], [10, 50, 90])
            print(f"{name:<30} {p50:>6.2f}x {p10:>5.2f}x {p90:>5.2f}x")
    return 0


EXECUTE_GOAL_US = 12.0
BASE = "baseline: "
MODE = "under mode: "
MODE_GOAL = 1.2


if __name__ == "__main__":
    raise SystemExit(main())
