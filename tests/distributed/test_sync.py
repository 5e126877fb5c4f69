"""`GroupSync` on a one-rank gloo group: the agreement's layout, config agreement, the fingerprint ranks share."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from graphcap.config import load_config
from graphcap.config.fingerprint import (
    PER_RANK_KEYS,
    agreed_items,
    compared_items,
    config_fingerprint,
    fingerprint_int,
)
from graphcap.distributed import GroupSync
from graphcap.distributed.sync import _describe


@pytest.fixture
def sync(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield GroupSync(dist.group.WORLD, timeout=30)
    finally:
        dist.destroy_process_group()


def test_equal_fingerprints_agree(sync):
    config = load_config()
    sync.agree_on_config(fingerprint_int(config), agreed_items(config))


def test_an_agreement_returns_the_maxed_payload_and_every_ranks_value(sync):
    agreement = sync.agree(3, "execute", [5, 0, 1, 2], value=7)
    assert agreement.payload == [5, 0, 1, 2] and agreement.values == [7]
    assert sync.reduce_max([4, 9], "bench") == [4, 9]
    assert sync.first_failed(None, 0, "key", "uniform(tokens=8, reqs=8)") is None
    assert sync.first_failed(0, 0, "key", "uniform(tokens=8, reqs=8)") == 0


def test_an_agreement_carries_at_most_eight_payload_values(sync):
    with pytest.raises(ValueError, match="at most 8 values; got 9"):
        sync.agree(1, "execute", list(range(9)))


def test_a_call_is_described_by_its_step_and_kind_in_out_of_step_messages():
    assert _describe((3 << 24) | (6 << 16)) == "execute() of step 3"
    assert _describe((2 << 24) | (2 << 16)) == "capture() starting after step 2"
    assert _describe((2 << 24) | (11 << 16)) == "capture_pending() starting after step 2"
    assert _describe((2 << 24) | (3 << 16) | 77) == "capturing a key (tag 77) after step 2"


def test_a_timeout_that_is_not_positive_is_refused(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        with pytest.raises(ValueError, match=r"timeout must be > 0 seconds \(Parallel\(timeout=...\)\); got 0"):
            GroupSync(dist.group.WORLD, timeout=0)
    finally:
        dist.destroy_process_group()


def test_fingerprint_covers_every_key_but_the_per_rank_ones():
    base = load_config()
    assert {"device", "report.path"} == PER_RANK_KEYS
    assert set(compared_items(base)) == set(compared_items(load_config())) and "device" not in compared_items(base)
    same = load_config(overrides={"device": "cpu", "report.path": "rank1.json"})
    assert config_fingerprint(same) == config_fingerprint(base)
    assert fingerprint_int(same) == fingerprint_int(base)
    for key, value in (
        ("capture.max_size", 32),
        ("padding.token_id", 1),
        ("model.seed", 1),
        ("checks.invariants", "full"),
    ):
        other = load_config(overrides={key: value})
        assert config_fingerprint(other) != config_fingerprint(base), key
        assert 0 <= fingerprint_int(other) < 2**62


def test_the_fingerprint_ranks_share_covers_the_torch_and_graphcap_versions(monkeypatch):
    import torch

    import graphcap.config.fingerprint as fingerprint

    config = load_config()
    items = agreed_items(config)
    assert items["version.torch"] == torch.__version__ and items["version.graphcap"]
    before = fingerprint_int(config)
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert fingerprint.agreed_items(config)["version.torch"] == "2.11.0"
    assert fingerprint_int(config) != before
    assert config_fingerprint(config) == config_fingerprint(load_config())  # a report's fingerprint is the config's
