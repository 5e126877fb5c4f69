"""`assert_nothing_left` after a failed pass: GC "left frozen" is judged against the frozen count before
the pass, never against 0 (CPython 3.12 starts with objects frozen; engines freeze their heap)."""

from __future__ import annotations

import gc

import pytest

from graphcap import CaptureError, CaptureManager
from graphcap.testing import FAULT_SIZES, assert_nothing_left, make_config, make_manager


@pytest.fixture
def frozen_heap():
    gc.freeze()  # an engine that froze its start-up heap (vLLM does): the count is not 0 on any Python
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()


def _failing(manager: CaptureManager, *, freeze: bool) -> CaptureManager:
    def forward(inputs):
        if freeze:
            gc.freeze()  # what graphcap must never do
        raise RuntimeError("model bug")

    manager._forward = forward
    with pytest.raises(CaptureError, match="model bug"):
        manager.capture()
    return manager


def test_a_heap_frozen_before_the_pass_is_not_reported_as_left_frozen(frozen_heap):
    assert frozen_heap > 0
    assert_nothing_left(_failing(make_manager(make_config(FAULT_SIZES)), freeze=False))


def test_a_pass_that_froze_the_heap_is_reported_with_both_counts(frozen_heap):
    manager = _failing(make_manager(make_config(FAULT_SIZES)), freeze=True)
    with pytest.raises(AssertionError, match=r"GC left frozen: \d+ objects frozen, \d+ before the pass"):
        assert_nothing_left(manager)


def test_a_manager_make_manager_did_not_make_needs_the_count_before():
    config = make_config(FAULT_SIZES)
    manager = CaptureManager(make_manager(config).model, config, backend="emulated", progress=False)
    with pytest.raises(ValueError, match=r"frozen_before is None.*pass frozen_before=gc.get_freeze_count\(\)"):
        assert_nothing_left(manager)
    assert_nothing_left(manager, frozen_before=gc.get_freeze_count())
