"""The memory estimate of piecewise keys says what it counts on each backend: on CUDA the pieces share the
pool and eager ops' tensors live in it unowned (no longer "an upper bound", which pinned tensors broke)."""

from graphcap.memory.estimate import estimate_memory
from graphcap.testing import make_config


def test_piecewise_keys_on_cuda_are_counted_in_the_shared_pool_not_as_an_upper_bound():
    config = make_config({"capture.mode": "full_and_piecewise", "model.attention": "per_request"})
    cuda = estimate_memory(config, backend="cuda")
    (note,) = cuda.notes
    assert "their pieces share the pool" in note and "upper bound" not in note
    assert "not counted" in cuda.describe()
    emulated = estimate_memory(config, backend="emulated")
    assert emulated.notes == ("piecewise keys counted as full graphs of their size (an upper bound)",)
