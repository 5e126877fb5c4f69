"""Steps: the hostile catalogue, fuzzed steps against the oracle, per-request outputs, whole
engine buffers, values stored as inf and the null block.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from graphcap import CaptureManager, StepBatch
from graphcap.keys import KeyRegistry
from graphcap.testing import (
    REFUSALS,
    Limits,
    assert_unchanged,
    check_plan,
    fill_batch,
    hostile_batches,
    make_config,
    make_manager,
    random_plan,
    snapshot,
    violations,
)

from .outputs import (
    DECLARED,
    INF_WHEN_STORED,
    NULL_BLOCK_STEPS,
    LastTokenLogits,
    WholeBuffer,
    check_inf_refused,
    check_null_block_refused,
    check_output_rows,
    check_whole_buffer,
    check_wrong_cut_refused,
    whole_spec,
)
from .trials import Row, Scale, Tally


def step_rows(scale: Scale, rng: np.random.Generator) -> list[Row]:
    config = make_config()
    manager = make_manager(config)
    manager.capture()
    catalogue = Tally()
    for hostile in hostile_batches(config):
        for run in (manager.execute, manager.eager):
            with catalogue.trial(f"{hostile.name} ({run.__name__})"):
                before = snapshot(manager)
                try:
                    run(StepBatch(*hostile.args))
                except REFUSALS as exc:
                    if not re.search(hostile.match, str(exc)):
                        raise AssertionError(f"message does not match {hostile.match!r}: {exc}") from None
                else:
                    raise AssertionError("accepted")
                assert_unchanged(manager, before)
    rows = [
        catalogue.row(
            "steps",
            "hostile catalogue (ids, lengths, blocks, counts, dtypes, shapes) x (execute, eager)",
            "refused naming field and index, buffers + KV cache + stats byte-identical",
        )
    ]

    valid, invalid = Tally(), Tally()
    lim = Limits.of(config)
    for i in range(scale.plans):
        plan = random_plan(rng, lim)
        tally = invalid if violations(plan, lim) else valid
        with tally.trial(f"plan {i}"):
            check_plan(manager, plan, lim)
    rows.append(
        valid.row(
            "steps",
            "fuzzed valid steps (by an oracle written apart from graphcap), any integer dtype",
            "accepted, graph (or eager fallback) == eager",
        )
    )
    rows.append(
        invalid.row(
            "steps",
            "fuzzed hostile steps (1-3 hostile edits, wrong dtypes and shapes)",
            "refused naming a broken field: BatchError with nothing written, or InvariantViolation "
            "with nothing read (KV cache and stats unchanged)",
        )
    )
    return rows


# -- silent wrong output or shape: per-request outputs, whole buffers, stored values, the null block --


def _mixed_batches(config, count: int, rng: np.random.Generator) -> Iterator[StepBatch]:
    """`count` real batches of random mixed keys of `config`, each with fewer requests than the key's rows."""
    keys = [key for key in KeyRegistry.from_config(config).planned if not key.uniform and key.num_reqs > 1]
    for i in range(count):
        key = keys[i % len(keys)]
        yield fill_batch(key, config, rng, int(rng.integers(1, key.num_reqs)))


def shape_rows(scale: Scale, rng: np.random.Generator) -> list[Row]:
    config = make_config()
    count = max(20, scale.plans // 10)
    steps = Tally()
    manager = CaptureManager(LastTokenLogits(config, DECLARED["dict"]), config, progress=False)
    manager.capture()
    for i, batch in enumerate(_mixed_batches(config, count, rng)):
        with steps.trial(f"step {i} ({batch.num_tokens} tokens, {batch.num_reqs} requests)"):
            check_output_rows(manager, batch)
    refused = Tally()
    for result in ("tensor", "tuple", "dict"):
        for wrong, verify in ((False, True), (True, True), (False, False)):
            with refused.trial(f"{result}, {'declared per token' if wrong else 'undeclared'}, verify {verify}"):
                check_wrong_cut_refused(make_config(capture__sizes=[8], checks__verify_replay=verify), result, wrong)
    whole = Tally()
    for shape in ((), (6,), (2, 3)):
        buffered = make_config(capture__sizes=[2, 4, 8])
        manager = CaptureManager(WholeBuffer(buffered, shape), buffered, progress=False, buffers=[whole_spec(shape)])
        with whole.trial(f"capture with a {shape} buffer"):
            if not all(record.verified for record in manager.capture().records):
                raise AssertionError("a key was not verified")
        for i, batch in enumerate(_mixed_batches(buffered, count // 3, rng)):
            with whole.trial(f"{shape} buffer, step {i}"):
                check_whole_buffer(manager, batch, rng)
    stored = Tally()
    for dtype, value in INF_WHEN_STORED:
        with stored.trial(f"{value!r} into {dtype}"):
            check_inf_refused(dtype, value)
    null = Tally()
    manager = make_manager(config)
    manager.capture()  # capture's own batches use the null block by design: they still verify
    for case in NULL_BLOCK_STEPS:
        with null.trial(case.name):
            check_null_block_refused(manager, case)
    return [
        steps.row(
            "outputs",
            "per-request outputs (`output_rows`: each request's last-token logits) over random steps at mixed keys, "
            "most with as many request rows as tokens",
            "execute == eager, num_reqs logits rows and num_tokens hidden rows",
        ),
        refused.row(
            "outputs",
            "per-request outputs undeclared or declared per token (tensor, tuple, dict) x verification on/off",
            "capture refused naming the output and the declaration to write, no graph left",
        ),
        whole.row(
            "engine buffers",
            "`none` buffers (scalar, (6,), (2, 3)): capture, then random steps with their own values",
            "verified with sampled values, the whole tensor at every key, execute == eager",
        ),
        stored.row(
            "engine buffers",
            "values a float buffer stores as inf (1e6, 70000.0, 65520.0, -1e5, 100000 in float16; 1e39 in float32)",
            "refused naming buffer, index and value, nothing written",
        ),
        null.row(
            "steps",
            "real steps reading or writing the null block (execute, eager); `block_table.set_row`/`append` of block 0",
            "refused naming the block-table entry, KV cache and stats unchanged",
        ),
    ]
