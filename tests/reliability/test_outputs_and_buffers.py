"""Silent wrong output or shape, a few of each (`tools/reliability.py` runs many): per-request outputs,
`none` engine buffers, values a buffer stores as inf, real steps naming the null block."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from graphcap import CaptureManager, GraphKey
from graphcap.testing import fill_batch, make_config, make_manager
from tests.tools import TOOLS

sys.path.insert(0, str(TOOLS))  # tools/campaign/: the checks, shared with the campaign

from campaign.outputs import (
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

KEYS = [GraphKey(8, 8, False), GraphKey(4, 4, False), GraphKey(2, 2, False)]  # as many request rows as tokens


def test_per_request_outputs_have_num_reqs_rows_at_every_mixed_key():
    config = make_config()
    manager = CaptureManager(LastTokenLogits(config, DECLARED["dict"]), config, progress=False)
    manager.capture()
    rng = np.random.default_rng(0)
    for key in KEYS:
        for num_reqs in range(1, key.num_reqs):
            check_output_rows(manager, fill_batch(key, config, rng, num_reqs))


@pytest.mark.parametrize("result", ["tensor", "tuple", "dict"])
@pytest.mark.parametrize(("wrong", "verify"), [(False, True), (True, True), (False, False)])
def test_a_wrong_cut_is_refused_at_capture_naming_the_declaration(result, wrong, verify):
    check_wrong_cut_refused(make_config(capture__sizes=[8], checks__verify_replay=verify), result, wrong)


@pytest.mark.parametrize("shape", [(), (6,), (2, 3)])
def test_a_none_buffer_is_whole_at_every_key(shape):
    config = make_config(capture__sizes=[2, 4])
    manager = CaptureManager(WholeBuffer(config, shape), config, progress=False, buffers=[whole_spec(shape)])
    assert all(record.verified for record in manager.capture().records)
    rng = np.random.default_rng(1)
    for key in KEYS[1:]:
        check_whole_buffer(manager, fill_batch(key, config, rng, 1), rng)


@pytest.mark.parametrize(("dtype", "value"), INF_WHEN_STORED)
def test_a_value_stored_as_inf_is_refused(dtype, value):
    check_inf_refused(dtype, value)


@pytest.mark.parametrize("case", NULL_BLOCK_STEPS, ids=[case.name for case in NULL_BLOCK_STEPS])
def test_a_real_step_naming_the_null_block_is_refused(case):
    manager = make_manager(make_config(capture__sizes=[2, 8]))
    manager.capture()  # capture's own batches share the null block by design: they still verify
    check_null_block_refused(manager, case)
