"""`bench_stage`'s comparisons: `--compare` (graphcap vs a vLLM-style host step), `--groups` (a second
KV-cache group vs engine buffers) and `--levels` (check_invariants basic and full, and the rule-by-rule
checks). Each prints its table and returns the exit status."""

from __future__ import annotations

import os
import platform

import numpy as np
import torch
from _stage_steps import (
    COMPARE_OVERRIDES,
    OVERRIDES,
    Case,
    graphcap_step,
    graphcap_table_step,
    interleaved,
    make_cases,
    make_compare_cases,
    with_upload,
)
from vllm_prep import VllmStylePrep, graphcap_real_rows, load_step, metadata_mismatches

from graphcap import BufferSpec
from graphcap.batch import StepBatch
from graphcap.checks.invariants import _check_full, _check_kv_writes, _lengths, check_invariants
from graphcap.config import CaptureConfig, load_config
from graphcap.keys import KeyRegistry
from graphcap.staging import PersistentBuffers


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
