"""Per-step host cost of staging: `StepBatch` + `PersistentBuffers.stage` + `check_invariants`.

Measures what every step pays on the host before a graph replays: build the `StepBatch`
from the scheduler's numpy arrays, stage it into the persistent buffers (real rows and
padded tail), and run the `basic` invariants. Beside it, in the same run, a straightforward
per-request Python builder (lists filled in a loop per request and token, then one
`torch.tensor` per field), the way a dummy run is often written by hand.

    python tools/bench_stage.py            # the full table (about a minute)
    python tools/bench_stage.py --quick    # a few repetitions, to see that it runs
    python tools/bench_stage.py --compare  # graphcap vs a vLLM-style host step (tools/vllm_prep.py)
    python tools/bench_stage.py --compare --peer-copies on   # ... with both sides' uploads
    python tools/bench_stage.py --groups   # a second KV-cache group: kv_cache.groups vs engine buffers
    python tools/bench_stage.py --levels   # check_invariants basic and full, and full's rule-by-rule checks

`--compare` times graphcap's two per-step paths against a numpy re-implementation of vLLM
v1's host-side input preparation (`tools/vllm_prep.py`; its docstring lists the vLLM steps
it includes and omits) on decode steps of 1 to 1024 requests and one mixed step:

- graphcap: `StepBatch` with a fresh block table array + `stage` + `check_invariants(basic)`;
- table: the same with the persistent block table (`buffers.block_table`), its rows
  written once before timing as vLLM's `add_request` writes its `BlockTable` rows;
- vllm-style: `prepare_inputs`. `--peer-copies off` (the default): the metadata
  computation only, no uploads and no pad fills (on a CPU an upload is a memcpy, so this
  is the cheaper, stricter peer). `--peer-copies on`: its six uploads (as copies into
  separate CPU tensors) and the two tail fills that precede them; graphcap's steps then
  also make the one upload they make on CUDA (a copy of the packed prefix).

All three first must produce the same real rows; then they run interleaved in rounds (one
block of calls each per round, the order rotating), so drift in the machine's speed hits
them alike. A ratio is graphcap's median over the vLLM-style median; the spreads are those
of the per-round median ratios (graphcap, then table).

Results are on stdout; see docs/BENCHMARKS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass

import numpy as np
import torch
from _sampling import measure
from vllm_prep import VllmStylePrep, graphcap_real_rows, load_step, metadata_mismatches

from graphcap import BufferSpec
from graphcap.batch import StepBatch
from graphcap.checks.invariants import _check_full, _check_kv_writes, _lengths, check_invariants
from graphcap.config import CaptureConfig, PadRules, load_config
from graphcap.keys import GraphKey, KeyRegistry, Mode
from graphcap.staging import PersistentBuffers

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
# --compare: 1024 decode requests with 128 blocks each (max_model_len 2048 at block_size 16),
# every request owning distinct blocks.
COMPARE_OVERRIDES = {**OVERRIDES, "kv_cache.max_model_len": 2048, "kv_cache.num_blocks": 1024 * 128 + 1}
COMPARE_DECODE_REQS = (1, 8, 64, 256, 1024)
COMPARE_MIXED = (4, 512, 252)  # prefills, tokens per prefill, decodes


@dataclass
class Case:
    name: str
    key: GraphKey
    # numpy arrays (what graphcap gets) and Python lists (what the builder gets)
    query_lens: np.ndarray
    seq_lens: np.ndarray
    input_ids: np.ndarray
    block_table: np.ndarray


def _decode_cases(config, registry, rng, blocks, reqs_list) -> list[Case]:
    """One decode step per request count, each request on its own row of `blocks`."""
    kv, width, vocab = config.kv_cache, config.kv_cache.max_blocks_per_req, config.model.vocab_size
    cases = []
    for num_reqs in reqs_list:
        q = np.ones(num_reqs, dtype=np.int32)
        s = rng.integers(1, kv.max_model_len + 1, num_reqs).astype(np.int32)
        ids = rng.integers(0, vocab, num_reqs).astype(np.int32)
        table = blocks[: num_reqs * width].reshape(num_reqs, width)
        cases.append(Case(f"decode {num_reqs} reqs", _key_for(registry, q, s), q, s, ids, table))
    return cases


def make_cases(config: CaptureConfig, registry: KeyRegistry, seed: int = 0) -> list[Case]:
    rng = np.random.default_rng(seed)
    kv = config.kv_cache
    width = kv.max_blocks_per_req
    vocab = config.model.vocab_size
    # Every request owns distinct blocks (block 0 is the null block).
    blocks = rng.permutation(np.arange(1, kv.num_blocks, dtype=np.int32))
    cases = _decode_cases(config, registry, rng, blocks, DECODE_REQS)
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


def make_compare_cases(config: CaptureConfig, registry: KeyRegistry, seed: int = 0) -> list[Case]:
    """Decode steps of `COMPARE_DECODE_REQS` requests and one mixed step (decodes, then prefill chunks).

    Every request owns distinct blocks, a full row of `max_blocks_per_req` of them.
    """
    rng = np.random.default_rng(seed)
    kv = config.kv_cache
    width = kv.max_blocks_per_req
    vocab = config.model.vocab_size
    blocks = rng.permutation(np.arange(1, kv.num_blocks, dtype=np.int32))
    cases = _decode_cases(config, registry, rng, blocks, COMPARE_DECODE_REQS)
    prefills, chunk, decodes = COMPARE_MIXED
    num_reqs = prefills + decodes
    # Decodes first, as engines that split decodes from prefills order the batch.
    q = np.concatenate([np.ones(decodes, dtype=np.int32), np.full(prefills, chunk, dtype=np.int32)])
    s = q + np.concatenate(
        [
            rng.integers(0, kv.max_model_len, decodes),  # decode: any context below max_model_len
            rng.integers(0, kv.max_model_len - chunk + 1, prefills),  # chunked prefill: a chunk after its context
        ]
    ).astype(np.int32)
    cases.append(
        Case(
            f"mixed {prefills}x{chunk} + {decodes} dec",
            _key_for(registry, q, s),
            q,
            s,
            rng.integers(0, vocab, int(q.sum())).astype(np.int32),
            blocks[: num_reqs * width].reshape(num_reqs, width),
        )
    )
    return cases


def _key_for(registry: KeyRegistry, query_lens: np.ndarray, seq_lens: np.ndarray) -> GraphKey:
    # The key a captured engine would replay: every planned key marked captured, then dispatch.
    for key in registry.planned:
        registry.mark_captured(key)
    batch = StepBatch(query_lens, seq_lens)
    mode, key, reason = registry.dispatch(
        batch.num_tokens, batch.num_reqs, batch.is_uniform(registry.uniform_query_len)
    )
    if mode is Mode.EAGER:
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


def interleaved(steps, rounds: int, calls: int, warmup: int) -> list[np.ndarray]:
    """Per-call microseconds of several step functions timed in turns: one [rounds, calls] array each.

    Each round times `calls` calls of each function in turn; the order rotates every round, so
    none always follows another's cache footprint.
    """
    for _ in range(warmup):
        for step in steps:
            step()
    samples = [np.empty((rounds, calls)) for _ in steps]
    for i in range(rounds):
        for j in range(len(steps)):
            k = (i + j) % len(steps)
            samples[k][i] = measure(steps[k], calls, 0)
    return samples


def graphcap_table_step(buffers: PersistentBuffers, case: Case):
    """The persistent-block-table path: the rows were written once (as requests arrived); a step names them."""
    table = buffers.block_table
    table.reset()
    for row, blocks in enumerate(case.block_table):
        table.set_row(row, blocks)
    query_lens, seq_lens, input_ids, key = case.query_lens, case.seq_lens, case.input_ids, case.key
    stage = buffers.stage

    def step() -> None:
        check_invariants(stage(StepBatch(query_lens, seq_lens, input_ids, table), key), "basic")

    return step


def with_upload(buffers: PersistentBuffers, key: GraphKey, step):
    """`step`, then the one upload graphcap issues on CUDA: a copy of the packed prefix (on CPU, a memcpy)."""
    packed = buffers.storage()["packed"]
    twin = torch.empty_like(packed)
    end = buffers.upload_nbytes(key)
    source, target = packed[:end], twin[:end]

    def stepped() -> None:
        step()
        target.copy_(source, non_blocking=True)

    return stepped


def compare(rounds: int, calls: int, warmup: int, peer_copies: bool) -> int:
    """graphcap's two paths vs the vLLM-style host step (tools/vllm_prep.py): same rows first, then time."""
    # vLLM's multiprocess workers run torch with one intra-op thread unless OMP_NUM_THREADS says
    # otherwise; do the same. (With more, each large upload `copy_` is an OpenMP region that
    # stalls for a whole scheduler slice, milliseconds, whenever another process holds a core.)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    config = load_config(overrides=COMPARE_OVERRIDES)
    registry = KeyRegistry.from_config(config)
    fresh = PersistentBuffers.from_config(config, "cpu")
    persistent = PersistentBuffers.from_config(config, "cpu")
    kv = config.kv_cache
    prep = VllmStylePrep(
        config.batching.max_num_seqs,
        config.batching.max_num_tokens,
        kv.max_model_len,
        kv.block_size,
        copies=peer_copies,
    )

    print(
        f"# bench_stage --compare: torch {torch.__version__}, numpy {np.__version__}, "
        f"python {platform.python_version()}"
    )
    print("# graphcap: StepBatch (fresh block table) + stage + check_invariants(basic)")
    print("# table: the same with the persistent block table (rows written once, named by the step)")
    print(
        "# vllm-style: tools/vllm_prep.py prepare_inputs, "
        + (
            "with its uploads (six copies and two tail fills); graphcap then also does its one upload copy"
            if peer_copies
            else "metadata computation only (no uploads, no pad fills: --peer-copies off)"
        )
    )
    print(f"# interleaved: {rounds} rounds x {calls} calls each, after {warmup} warm-up calls each")
    print(f"# torch intra-op threads: {torch.get_num_threads()}; ratio = graphcap median / vllm-style median")
    header = (
        f"{'case':<26} {'key':<30} {'graphcap med':>12} {'p90':>7} {'table med':>9} {'p90':>7} "
        f"{'vllm med':>9} {'p90':>7} {'ratio':>6} {'table ratio':>11} {'round ratio p10-p90':>20} {'min-max':>10}"
    )
    print(header)
    print("-" * len(header))
    for case in make_compare_cases(config, registry):
        width = case.block_table.shape[1]
        loaded = load_step(prep, case.query_lens, case.seq_lens, case.input_ids, case.block_table)
        ours = graphcap_step(fresh, case)
        table = graphcap_table_step(persistent, case)
        # Same real rows before any timing, on both graphcap paths: the comparison is like for like.
        loaded.step()
        theirs = loaded.metadata()
        for buffers, block_table in ((fresh, case.block_table), (persistent, persistent.block_table)):
            batch = StepBatch(case.query_lens, case.seq_lens, case.input_ids, block_table)
            inputs = buffers.stage(batch, case.key)
            expected = graphcap_real_rows(inputs.host, inputs.num_reqs, inputs.num_tokens, width)
            bad = metadata_mismatches(expected, theirs, width)
            if bad:
                raise SystemExit(f"bench_stage: {case.name}: graphcap and vllm-style rows differ in {', '.join(bad)}")
        if peer_copies:
            ours, table = with_upload(fresh, case.key, ours), with_upload(persistent, case.key, table)
        g, t, v = interleaved([ours, table, loaded.step], rounds, calls, warmup)
        gmed, gp90 = np.median(g), np.percentile(g, 90)
        tmed, tp90 = np.median(t), np.percentile(t, 90)
        vmed, vp90 = np.median(v), np.percentile(v, 90)
        per_round = np.median(g, axis=1) / np.median(v, axis=1)
        per_round_table = np.median(t, axis=1) / np.median(v, axis=1)
        lo, hi = np.percentile(per_round, [10, 90])
        tlo, thi = np.percentile(per_round_table, [10, 90])
        print(
            f"{case.name:<26} {case.key!s:<30} {gmed:>10.1f}us {gp90:>5.1f}us {tmed:>7.1f}us {tp90:>5.1f}us "
            f"{vmed:>7.1f}us {vp90:>5.1f}us {gmed / vmed:>6.2f} {tmed / vmed:>11.2f} "
            f"{lo:>8.2f}-{hi:<4.2f} {tlo:>4.2f}-{thi:<4.2f} {per_round.min():>4.2f}-{per_round.max():<4.2f}"
        )
    return 0


GROUP_BLOCK_SIZE = 32
"""Block size of the second KV-cache group of `--groups` (the built-in group's is 16)."""


def group_steps(config: CaptureConfig, registry: KeyRegistry, case: Case):
    """A decode step with a second KV-cache group, two ways, over the same real rows.

    `group`: the group declared in `kv_cache.groups`, its persistent table's rows written once, the
    step naming both persistent tables; staging computes the group's slots from the positions.
    `buffers`: the same group declared as two engine buffers (its table `[R, B2]` and slot mapping
    `[T]`), the engine computing the slots each step and passing both arrays, copied and scanned.
    Returns the two step functions and a check that they staged the same group rows.
    """
    kv = config.kv_cache
    width = -(-kv.max_model_len // GROUP_BLOCK_SIZE)
    rng = np.random.default_rng(1)
    r = len(case.query_lens)
    second = rng.permutation(np.arange(1, r * width + 1, dtype=np.int32)).reshape(r, width)
    group = {"name": "g2", "block_size": GROUP_BLOCK_SIZE, "num_blocks": r * width + 1}
    grouped = PersistentBuffers.from_config(load_config(overrides={**COMPARE_OVERRIDES, "kv_cache.groups": [group]}))
    specs = [
        BufferSpec("g2_block_table", "reqs", shape=(width,), pad=0),
        BufferSpec("g2_slot_mapping", "tokens", pad=config.padding.slot),
    ]
    plain = PersistentBuffers.from_config(config, extras=specs)
    for buffers in (grouped, plain):
        for row, blocks in enumerate(case.block_table):
            buffers.block_table.set_row(row, blocks)
    g2 = grouped.kv_groups.tables["g2"]
    for row, blocks in enumerate(second):
        g2.set_row(row, blocks)
    q, s, ids, key = case.query_lens, case.seq_lens, case.input_ids, case.key
    rows, bs = np.arange(r), GROUP_BLOCK_SIZE
    table, table2, stage, stage_plain = grouped.block_table, plain.block_table, grouped.stage, plain.stage

    def group_step() -> None:
        check_invariants(stage(StepBatch(q, s, ids, table, kv_groups={"g2": g2}), key), "basic")

    def buffer_step() -> None:
        pos = s - 1  # the engine's own slot computation for its second group
        slots = second[rows, pos // bs] * bs + pos % bs
        extras = {"g2_block_table": second, "g2_slot_mapping": slots}
        check_invariants(stage_plain(StepBatch(q, s, ids, table2, extras=extras), key), "basic")

    def same_rows() -> bool:
        group_step()
        buffer_step()
        staged = grouped.host["kv_groups.g2.slot_mapping"][:r], grouped.host["kv_groups.g2.block_table"][:r]
        theirs = plain.host["g2_slot_mapping"][:r], plain.host["g2_block_table"][:r]
        return all(np.array_equal(a, b) for a, b in zip(staged, theirs))

    return group_step, buffer_step, same_rows


def groups(rounds: int, calls: int, warmup: int) -> int:
    """A second KV-cache group as a `kv_cache.groups` entry vs as two engine buffers, interleaved."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    config = load_config(overrides=COMPARE_OVERRIDES)
    registry = KeyRegistry.from_config(config)
    print(
        f"# bench_stage --groups: torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}"
    )
    print(f"# decode steps with a second KV-cache group (block size {GROUP_BLOCK_SIZE}), persistent built-in table")
    print("# group: kv_cache.groups, its persistent table named by the step, slots staged from positions")
    print("# buffers: the group as two BufferSpecs, slots computed by the engine and both arrays passed each step")
    print(f"# interleaved: {rounds} rounds x {calls} calls each, after {warmup} warm-up calls each")
    header = f"{'case':<18} {'group med':>10} {'p90':>7} {'buffers med':>12} {'p90':>7} {'ratio':>6}"
    header += f" {'round ratio p10-p90':>20}"
    print(header)
    print("-" * len(header))
    for case in make_compare_cases(config, registry)[:-1]:  # the decode steps
        group_step, buffer_step, same_rows = group_steps(config, registry, case)
        if not same_rows():
            raise SystemExit(f"bench_stage: {case.name}: the two forms staged different group rows")
        g, b = interleaved([group_step, buffer_step], rounds, calls, warmup)
        per_round = np.median(g, axis=1) / np.median(b, axis=1)
        lo, hi = np.percentile(per_round, [10, 90])
        print(
            f"{case.name:<18} {np.median(g):>8.1f}us {np.percentile(g, 90):>5.1f}us {np.median(b):>10.1f}us "
            f"{np.percentile(b, 90):>5.1f}us {np.median(g) / np.median(b):>6.2f} {lo:>14.2f}-{hi:<4.2f}"
        )
    return 0


def rule_by_rule(inputs) -> None:
    """The `full` checks one rule at a time, as every `full` step ran them before `full_holds` (they now name a
    broken rule after the proof said False)."""
    check_invariants(inputs, "basic")
    lens = _lengths(inputs.host.query_start_loc)
    _check_full(inputs, lens)
    _check_kv_writes(inputs, lens, False)


def levels(rounds: int, calls: int, warmup: int) -> int:
    """check_invariants at basic and full, and full's rule-by-rule checks, on the same staged steps, interleaved."""
    torch.set_num_threads(1)
    config = load_config(overrides=OVERRIDES)
    registry = KeyRegistry.from_config(config)
    buffers = PersistentBuffers.from_config(config, "cpu")
    print(f"# bench_stage --levels: numpy {np.__version__}, python {platform.python_version()}")
    print("# one staged step per case (persistent block table); check_invariants only, no staging")
    print(f"# interleaved: {rounds} rounds x {calls} calls each; spread = p10-p90 of the per-round medians")
    header = f"{'case':<28} {'basic':>8} {'full':>8} {'rule by rule':>13} {'full/rules':>11} {'p10-p90':>11}"
    print(header)
    print("-" * len(header))
    goal = None
    for case in make_cases(config, registry):
        table = buffers.block_table
        table.reset()
        for row, blocks in enumerate(case.block_table):
            table.set_row(row, blocks)
        inputs = buffers.stage(StepBatch(case.query_lens, case.seq_lens, case.input_ids, table), case.key)
        steps = [
            lambda inputs=inputs: check_invariants(inputs, "basic"),
            lambda inputs=inputs: check_invariants(inputs, "full"),
            lambda inputs=inputs: rule_by_rule(inputs),
        ]
        basic, full, rules = (np.median(s, axis=1) for s in interleaved(steps, rounds, calls, warmup))
        ratio = full / rules
        lo, hi = np.percentile(ratio, [10, 90])
        print(
            f"{case.name:<28} {np.median(basic):>6.1f}us {np.median(full):>6.1f}us {np.median(rules):>11.1f}us "
            f"{np.median(ratio):>11.2f} {lo:>5.2f}-{hi:<5.2f}"
        )
        if case.name == FULL_GOAL_CASE:
            goal = (np.median(full), np.median(ratio))
    if goal is not None:
        print(
            f"goal: full at {FULL_GOAL_CASE} <= {FULL_GOAL_US:g} us, i.e. <= {FULL_GOAL_US / FULL_RULES_US:.2f}x "
            f"of the rule-by-rule checks ({FULL_RULES_US:g} us on the reference VM): "
            f"now {goal[0]:.1f} us, {goal[1]:.2f}x"
        )
    return 0


FULL_GOAL_CASE, FULL_GOAL_US, FULL_RULES_US = "decode 256 reqs", 25.0, 70.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few repetitions (seconds, for tests)")
    parser.add_argument("--repeats", type=int, default=3000, help="timed steps per case (graphcap)")
    parser.add_argument("--compare", action="store_true", help="graphcap vs a vLLM-style host step (vllm_prep.py)")
    parser.add_argument("--levels", action="store_true", help="check_invariants basic vs full vs rule by rule")
    parser.add_argument("--rounds", type=int, default=50, help="--compare: interleaved rounds per case")
    parser.add_argument("--calls", type=int, default=100, help="--compare: timed calls per side per round")
    parser.add_argument(
        "--peer-copies",
        choices=("on", "off"),
        default="off",
        help="--compare: off (default): the vLLM-style step computes the metadata only; on: it also uploads "
        "(six copies, two tail fills) and graphcap also does its one upload copy",
    )
    parser.add_argument(
        "--groups", action="store_true", help="a second KV-cache group: kv_cache.groups vs two engine buffers"
    )
    args = parser.parse_args(argv)
    if args.groups:
        return groups(4, 10, 5) if args.quick else groups(args.rounds, args.calls, warmup=200)
    if args.levels:
        return levels(4, 10, 5) if args.quick else levels(args.rounds, args.calls, warmup=200)
    if args.compare:
        copies = args.peer_copies == "on"
        if args.quick:
            return compare(rounds=4, calls=10, warmup=5, peer_copies=copies)
        return compare(args.rounds, args.calls, warmup=200, peer_copies=copies)
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
