"""Per-step host cost of staging: `StepBatch` + `PersistentBuffers.stage` + `check_invariants`.

Measures what every step pays on the host before a graph replays: build the `StepBatch`
from the scheduler's numpy arrays, stage it into the persistent buffers (real rows and
padded tail), and run the `basic` invariants. Beside it, in the same run, a straightforward
per-request Python builder (lists filled in a loop per request and token, then one
`torch.tensor` per field), the way a dummy run is often written by hand.

    python tools/bench_stage.py            # the full table (about a minute)
    python tools/bench_stage.py --quick    # a few repetitions, to see that it runs

Results are on stdout; see docs/BENCHMARKS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import dataclass

import numpy as np
import torch
from _sampling import measure

from graphcap.batch import GraphKey, StepBatch
from graphcap.buffers import PersistentBuffers
from graphcap.config import CaptureConfig, PadRules, load_config
from graphcap.dispatch import KeyRegistry
from graphcap.invariants import check_invariants

# Buffers big enough for 1024 decode requests with their own blocks, and a 2048-token prefill.
OVERRIDES = {
    "batching.max_num_seqs": 1024,
    "batching.max_num_tokens": 4096,
    "kv_cache.block_size": 16,
    "kv_cache.max_model_len": 1024,
    "kv_cache.num_blocks": 1024 * 64 + 1,
    "capture.max_size": 4096,
    "model.vocab_size": 32000,
}
DECODE_REQS = (1, 64, 256, 1024)
PREFILL = (8, 2048)  # requests, tokens


@dataclass
class Case:
    name: str
    key: GraphKey
    # numpy arrays (what graphcap gets) and Python lists (what the builder gets)
    query_lens: np.ndarray
    seq_lens: np.ndarray
    input_ids: np.ndarray
    block_table: np.ndarray


def make_cases(config: CaptureConfig, registry: KeyRegistry, seed: int = 0) -> list[Case]:
    rng = np.random.default_rng(seed)
    kv = config.kv_cache
    width = kv.max_blocks_per_req
    vocab = config.model.vocab_size
    # Every request owns distinct blocks (block 0 is the null block).
    blocks = rng.permutation(np.arange(1, kv.num_blocks, dtype=np.int32))
    cases = []
    for num_reqs in DECODE_REQS:
        q = np.ones(num_reqs, dtype=np.int32)
        s = rng.integers(1, kv.max_model_len + 1, num_reqs).astype(np.int32)
        cases.append(
            Case(
                f"decode {num_reqs} reqs",
                _key_for(registry, q, s),
                q,
                s,
                rng.integers(0, vocab, num_reqs).astype(np.int32),
                blocks[: num_reqs * width].reshape(num_reqs, width),
            )
        )
    num_reqs, num_tokens = PREFILL
    q = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
    # Chunked prefill: each chunk follows some context already in the cache.
    s = q + rng.integers(0, kv.max_model_len - q.max() + 1, num_reqs).astype(np.int32)
    cases.append(
        Case(
            f"prefill {num_reqs} reqs, {num_tokens} tok",
            _key_for(registry, q, s),
            q,
            s,
            rng.integers(0, vocab, num_tokens).astype(np.int32),
            blocks[: num_reqs * width].reshape(num_reqs, width),
        )
    )
    return cases


def _key_for(registry: KeyRegistry, query_lens: np.ndarray, seq_lens: np.ndarray) -> GraphKey:
    # The key a captured engine would replay: every planned key marked captured, then dispatch.
    for key in registry.planned:
        registry.mark_captured(key)
    key, reason = registry.dispatch(StepBatch(query_lens, seq_lens))
    if key is None:
        raise SystemExit(f"bench_stage: no key for the batch ({reason})")
    return key


def graphcap_step(buffers: PersistentBuffers, case: Case):
    """One step of the engine's host path, as a closure over local names (no harness lookups)."""
    query_lens, seq_lens, input_ids, block_table, key = (
        case.query_lens,
        case.seq_lens,
        case.input_ids,
        case.block_table,
        case.key,
    )
    stage = buffers.stage

    def step() -> None:
        batch = StepBatch(query_lens, seq_lens, input_ids, block_table)
        check_invariants(stage(batch, key), "basic")

    return step


def python_step(
    query_lens: list[int],
    seq_lens: list[int],
    input_ids: list[int],
    block_table: list[list[int]],
    key: GraphKey,
    block_size: int,
    max_blocks: int,
    pad: PadRules,
) -> dict[str, torch.Tensor]:
    """The baseline: per-request, per-token Python lists, then one tensor per field."""
    T, R = key.num_tokens, key.num_reqs
    query_start_loc = [0]
    positions: list[int] = []
    slot_mapping: list[int] = []
    lens: list[int] = []
    rows: list[list[int]] = []
    for query_len, seq_len, row in zip(query_lens, seq_lens, block_table):
        query_start_loc.append(query_start_loc[-1] + query_len)
        lens.append(seq_len)
        for position in range(seq_len - query_len, seq_len):
            positions.append(position)
            slot_mapping.append(row[position // block_size] * block_size + position % block_size)
        rows.append(list(row) + [pad.block_id] * (max_blocks - len(row)))
    num_tokens, num_reqs = len(positions), len(lens)
    ids = list(input_ids)
    for _ in range(num_reqs, R):
        query_start_loc.append(num_tokens)
        lens.append(pad.seq_len)
        rows.append([pad.block_id] * max_blocks)
    for _ in range(num_tokens, T):
        positions.append(pad.position)
        slot_mapping.append(pad.slot)
        ids.append(pad.token_id)
    fields = {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "query_start_loc": query_start_loc,
        "seq_lens": lens,
        "block_table": rows,
    }
    return {name: torch.tensor(values, dtype=torch.int32) for name, values in fields.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few repetitions (seconds, for tests)")
    parser.add_argument("--repeats", type=int, default=3000, help="timed steps per case (graphcap)")
    args = parser.parse_args(argv)
    repeats = 20 if args.quick else args.repeats
    warmup = 5 if args.quick else 300
    # The Python builder is ~100x slower; fewer samples give the same median precision.
    builder_repeats = 3 if args.quick else max(5, repeats // 10)

    config = load_config(overrides=OVERRIDES)
    registry = KeyRegistry.from_config(config)
    buffers = PersistentBuffers.from_config(config, "cpu")
    kv = config.kv_cache

    print(f"# bench_stage: torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}")
    print(f"# per step: StepBatch + stage + check_invariants(basic); {repeats} steps after {warmup} warm-up")
    header = f"{'case':<28} {'key':<28} {'graphcap med':>12} {'p90':>8} {'python med':>11} {'p90':>9} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for case in make_cases(config, registry):
        ours = measure(graphcap_step(buffers, case), repeats, warmup)
        lists = (case.query_lens.tolist(), case.seq_lens.tolist(), case.input_ids.tolist(), case.block_table.tolist())

        def builder(lists=lists, key=case.key):
            return python_step(*lists, key, kv.block_size, kv.max_blocks_per_req, config.padding)

        # Same values as the staged buffers: the comparison is like for like.
        inputs = buffers.stage(StepBatch(case.query_lens, case.seq_lens, case.input_ids, case.block_table), case.key)
        for name, tensor in builder().items():
            torch.testing.assert_close(getattr(inputs, name), tensor, rtol=0, atol=0, msg=name)
        theirs = measure(builder, builder_repeats, max(1, warmup // 10))
        med, p90 = np.median(ours), np.percentile(ours, 90)
        bmed, bp90 = np.median(theirs), np.percentile(theirs, 90)
        print(
            f"{case.name:<28} {case.key!s:<28} {med:>10.1f}us {p90:>6.1f}us "
            f"{bmed:>9.0f}us {bp90:>7.0f}us {bmed / med:>7.0f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
