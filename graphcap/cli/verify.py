"""`graphcap verify`: capture, prove the staging of every key, then replay random steps vs eager."""

from __future__ import annotations

import argparse

from graphcap.cli._common import add_common, check_at_least, stage
from graphcap.cli.capture import check_something_captured

EPILOG = """examples:
  graphcap verify                                  # embedded default, 8 random sequences
  graphcap verify --config tiny-cpu-ci --batches 4 # seconds
  graphcap verify --config spec-decode --batches 20 --seed 3

How long: the embedded default takes 2-6 minutes on a 2-core CPU (mostly the random
sequences, each step run twice: replayed and eagerly); tiny-cpu-ci about 10 seconds.
Each sequence is a step of the progress bar on stderr (a terminal only; --no-progress).

Exit 0 when every staged key passes its invariants and every replayed step equals eager,
1 on any mismatch or violation (the key, the batch and the field are named), 2 for a
config or usage error.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "verify",
        help="capture, then check every key's staging and random steps against eager",
        description="Capture the graphs of a config, stage every key with every number of real requests it "
        "holds (full invariants), then run random step sequences (decode, mixed prefill, spec-decode when "
        "configured) through the graphs and compare each step with an eager run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(parser)
    parser.add_argument("--batches", type=int, default=8, metavar="N", help="random step sequences (default 8)")
    parser.add_argument("--steps", type=int, default=24, metavar="N", help="steps per sequence (default 24)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from graphcap.cli._setup import build_manager

    check_at_least(batches=(args.batches, 0), steps=(args.steps, 1), seed=(args.seed, 0))
    manager = build_manager(args)
    stage("capturing")
    report = manager.capture()
    print(f"captured {len(report.captured)} graphs ({len(report.skipped)} skipped) in {report.total_seconds:.2f} s")
    check_something_captured(report)
    stage("staging every key")
    staged = sweep_keys(manager)
    print(f"staging sweep: {staged} (key, real requests) combinations pass the full invariants")
    stage("replaying random steps")
    failures, steps = replay_sequences(manager, args.batches, args.steps, args.seed, progress=not args.no_progress)
    stats = manager.stats.as_dict()
    print(
        f"random steps: {steps} compared with eager, {sum(stats['graph_hits'].values())} replayed, "
        f"{sum(stats['eager'].values())} eager ({', '.join(f'{k} {v}' for k, v in stats['eager'].items()) or 'none'}), "
        f"padded-token waste {stats['padded_token_waste']:.1%}"
    )
    for failure in failures[:20]:
        print(f"MISMATCH {failure}")
    print("verify: ok" if not failures else f"verify: FAILED ({len(failures)} steps)")
    return 1 if failures else 0


def sweep_keys(manager) -> int:
    """Stage every captured key with 0..R real requests (R: its request rows, or for a piecewise
    key `min(tokens, max_num_seqs)`); raise on any violation."""
    import numpy as np

    from graphcap.checks.invariants import check_invariants
    from graphcap.errors import InvariantViolation
    from graphcap.workload import fill_batch

    config = manager.config
    rng = np.random.default_rng(0)
    count = 0
    for key in sorted(manager.graphs):
        for num_reqs in range(manager.registry.capture_shape(key).num_reqs + 1):
            batch = fill_batch(key, config, rng, num_reqs)
            try:
                check_invariants(manager.buffers.stage(batch, key), "full")
            except InvariantViolation as exc:
                why = f"{exc.why} (while staging {batch})"
                raise InvariantViolation(exc.field, exc.index, exc.expected, exc.actual, why, key) from None
            count += 1
    return count


def replay_sequences(
    manager, num_sequences: int, num_steps: int, seed: int, *, progress: bool = True
) -> tuple[list[str], int]:
    """Random step sequences through `execute` vs `eager`; returns (failures, steps compared).

    `progress`: a bar over the sequences on stderr (`tqdm(disable=None)`: a terminal only); False: none."""
    import sys

    from tqdm import tqdm

    from graphcap.capture.verification import assert_close
    from graphcap.errors import InvariantViolation
    from graphcap.workload import Workload

    config = manager.config
    tolerance = config.checks.tolerance
    q = config.capture.uniform_query_len
    max_size = manager.registry.sizes.max_size
    failures: list[str] = []
    steps = 0
    bar = tqdm(
        range(num_sequences), desc="sequences", unit="seq", file=sys.stderr, disable=None if progress else True,
        leave=False,
    )  # fmt: skip
    for sequence in bar:
        workload = Workload(config, seed=seed * 1000 + sequence, spec_len=q, chunk=int(1 + sequence % 4 * 8))
        for _ in range(int(workload.rng.integers(1, config.batching.max_num_seqs + 1))):
            workload.add_random()
        for _ in range(num_steps):
            if not workload.running:
                break
            # Mostly budgets within the captured range (graph steps), sometimes above it (eager).
            top = max_size if workload.rng.random() < 0.8 else config.batching.max_num_tokens
            batch = workload.next_batch(max_tokens=int(workload.rng.integers(1, top + 1)))
            if batch.num_reqs == 0:
                break
            key = None
            try:
                got = manager.execute(batch).clone()
                key = manager.last_key
                want = manager.eager(batch)
                assert_close(got, want, **tolerance)
            except (AssertionError, InvariantViolation) as exc:
                detail = str(exc).strip().splitlines()
                failures.append(f"sequence {sequence}, key {key}, {batch}: {'; '.join(detail[:2])}")
                break
            steps += 1
            workload.advance(got)
        bar.set_postfix_str(f"{steps} steps", refresh=False)
    bar.close()
    return failures, steps
