"""Functional collectives on the emulated backend's tape (one gloo rank; tests/distributed runs several).

A recorded collective is an op of the tape: every replay runs it again (on several ranks, with
the peers replaying theirs), on the values the replay computed, not the capture's.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tests.distributed._models import tape_ops


@pytest.fixture
def group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=g), torch.randn(4, 4, generator=g)


def test_funcol_all_reduce_records_the_collective_and_its_wait_and_replays_on_new_values(emulated, group):
    x, w = _inputs()

    def forward():
        y = funcol.all_reduce(x @ w, "sum", group)  # an AsyncCollectiveTensor
        return torch.cat([y, y + 1])  # used twice, inside a list: one recorded wait

    graph = emulated.capture(forward, {"x": x}, name="key")
    ops = tape_ops(graph)
    assert ops.count("_c10d_functional::all_reduce") == 1 and ops.count("_c10d_functional::wait_tensor") == 1, ops
    x.copy_(torch.randn(3, 4))
    torch.testing.assert_close(graph.replay(), torch.cat([x @ w, x @ w + 1]))
