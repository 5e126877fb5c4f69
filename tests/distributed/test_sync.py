"""`DataParallelSync` on a one-rank gloo group: config agreement and the out-of-step guard."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from graphcap.config import load_config
from graphcap.config.fingerprint import PER_RANK_KEYS, compared_items, config_fingerprint, fingerprint_int
from graphcap.distributed import DataParallelSync
from graphcap.errors import DistributedTimeoutError


@pytest.fixture
def sync(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield DataParallelSync(dist.group.WORLD, timeout=30)
    finally:
        dist.destroy_process_group()


def test_equal_fingerprints_agree(sync):
    config = load_config()
    sync.agree_on_config(fingerprint_int(config), compared_items(config))
    assert sync.step == 0  # agreement is not a step: step numbers in errors stay the engine's


def test_a_failure_flag_out_of_range_means_the_ranks_are_out_of_step(sync, monkeypatch):
    # What "rank -6 failed to capture it" came from: a peer's reply to another collective.
    monkeypatch.setattr(sync, "reduce_max", lambda values, what: [7])
    with pytest.raises(DistributedTimeoutError, match=r"the ranks are out of step \(a peer sent 7"):
        sync.first_failed_rank(False, "capture of uniform(tokens=8, reqs=8)")


def test_fingerprint_covers_every_key_but_the_per_rank_ones():
    base = load_config()
    assert {"device", "report.path"} == PER_RANK_KEYS
    assert set(compared_items(base)) == set(compared_items(load_config())) and "device" not in compared_items(base)
    same = load_config(overrides={"device": "cpu", "report.path": "rank1.json"})
    assert config_fingerprint(same) == config_fingerprint(base)
    for key, value in (
        ("capture.max_size", 32),
        ("padding.token_id", 1),
        ("model.seed", 1),
        ("checks.invariants", "full"),
    ):
        other = load_config(overrides={key: value})
        assert config_fingerprint(other) != config_fingerprint(base), key
        assert 0 <= fingerprint_int(other) < 2**62
