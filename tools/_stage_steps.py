"""`bench_stage`'s cases and the steps it times: the configs, the decode and mixed cases, graphcap's step
(`StepBatch` + `stage` + `check_invariants`), the hand-written Python builder it is compared with, and the
interleaved timer of `--compare`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from _sampling import measure

from graphcap.batch import StepBatch
from graphcap.checks.invariants import check_invariants
from graphcap.config import CaptureConfig, PadRules
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
