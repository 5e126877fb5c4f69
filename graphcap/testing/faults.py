"""Faults and snapshots: a model that fails on demand, and checks that a failure left nothing.

`FaultyModel` wraps a model and raises an armed exception from `forward` in one phase of one
size's capture (warmup, capture, verification); `snapshot`/`assert_unchanged` prove a refused
step wrote nothing; `hostile_batches` is a catalogue of steps that must be refused.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import torch

from graphcap.config import CaptureConfig
from graphcap.manager import CaptureManager
from graphcap.phases import phase

__all__ = [
    "FAULTS",
    "MOVES",
    "Move",
    "expect",
    "PHASES",
    "FaultyModel",
    "Wrapped",
    "Hostile",
    "Snapshot",
    "assert_nothing_left",
    "assert_unchanged",
    "hostile_batches",
    "kv_cache",
    "leftover_temp_files",
    "remember_freeze_count",
    "snapshot",
]


def expect(condition: bool, message: str) -> None:
    """`assert` that survives `python -O`: raise AssertionError(message) unless `condition`."""
    if not condition:
        raise AssertionError(message)


def kv_cache(manager: CaptureManager) -> torch.Tensor:
    """The reference model's KV cache (through a `FaultyModel` wrapper too)."""
    return manager.model.kv_cache


class Wrapped(torch.nn.Module):
    """A model around another (`inner`): the same forward and KV cache; a test overrides `forward` to change it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def kv_cache(self) -> torch.Tensor:
        # torch types a submodule's attributes as `Tensor | Module`; the wrapped model's cache is a tensor.
        return cast(torch.Tensor, self.inner.kv_cache)

    def forward(self, inputs):
        return self.inner(inputs)


class FaultyModel(Wrapped):
    """The reference model with at most one armed fault, raised from `forward`.

    Calls are counted per key since `arm`: with one warmup and `verify_replay` on the emulated backend, call 1
    of a key is its plain warmup, call 2 its capture (the recording, which runs the preflight's checks: no
    separate checked run) and call 3 the first eager run of its verification (`PHASES`), so `on_call` picks
    the phase that fails. A key whose every probe batch an earlier key of the pass probed runs no eager run in
    its verification (the kept results, `graphcap.capture.references`): with `FAULT_SIZES`, size 4's keys each run
    one, size 2's none. A verification forward counts for the key it verifies: its own key (a dummy batch
    run again), else the key verified by the verification forward before it, else the key captured last (a
    key verified right after its capture: the probe batch, staged at an eager key of its own size).
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__(inner)
        self.fault: tuple[int, Callable[[], BaseException], int | None, bool | None] | None = None
        self.calls: Counter = Counter()
        self._captured = self._verifying = None
        self._recorded: set = set()

    def arm(
        self,
        num_tokens: int,
        make_exc: Callable[[], BaseException],
        on_call: int | None = None,
        *,
        uniform: bool | None = None,
    ) -> None:
        """Raise `make_exc()` when a key of `num_tokens` runs (on its `on_call`-th call, or every call); `uniform`:
        only the uniform (True) or the mixed (False) key of that size (None: both)."""
        self.fault = (num_tokens, make_exc, on_call, uniform)
        self.calls.clear()
        self._captured = self._verifying = None
        self._recorded.clear()

    def disarm(self) -> None:
        self.fault = None

    def forward(self, inputs) -> torch.Tensor:
        key, now = inputs.key, phase()
        if now == "verify":
            key = self._verifying = key if key in self._recorded else (self._verifying or self._captured)
        else:
            self._verifying = None
        self.calls[key] += 1
        if now == "capture":
            self._captured = key
            self._recorded.add(key)
        if self.fault is not None:
            num_tokens, make_exc, on_call, uniform = self.fault
            if key.num_tokens == num_tokens and on_call in (None, self.calls[key]) and uniform in (None, key.uniform):
                raise make_exc()
        return self.inner(inputs)


FAULTS: dict[str, Callable[[], BaseException]] = {
    "error": lambda: RuntimeError("injected fault: the forward failed"),
    "oom": lambda: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.8 GiB"
    ),
    "oom_no_message": lambda: torch.OutOfMemoryError(),
    "interrupt": KeyboardInterrupt,
}
PHASES = {1: "warmup", 2: "capture", 3: "verify"}


def leftover_temp_files(path: Path) -> list[Path]:
    """Temporary files `atomic_write` would leave next to `path` if it failed to clean up."""
    return sorted(path.parent.glob(f".{path.name}.*"))


_FROZEN_WHEN_MADE: weakref.WeakKeyDictionary[CaptureManager, int] = weakref.WeakKeyDictionary()


def remember_freeze_count(manager: CaptureManager) -> CaptureManager:
    """Note `gc.get_freeze_count()` now, as `manager`'s count before any pass (`make_manager` calls it)."""
    _FROZEN_WHEN_MADE[manager] = gc.get_freeze_count()
    return manager


def assert_nothing_left(manager: CaptureManager, *, frozen_before: int | None = None) -> None:
    """After a failed or interrupted pass: GC restored, no graph registered or holding memory.

    GC "left frozen" means the permanent generation grew past `frozen_before`, its size
    (`gc.get_freeze_count()`) before the pass; by default the size when `make_manager` made `manager`.
    Never compared with 0: CPython 3.12 starts with objects there, and an engine may freeze its own heap
    (vLLM calls `gc.freeze()` after start-up). Refcounting may free frozen objects, so it may shrink.
    """
    if frozen_before is None:
        frozen_before = _FROZEN_WHEN_MADE.get(manager)
    if frozen_before is None:
        raise ValueError(
            "assert_nothing_left: frozen_before is None and make_manager did not make this manager; pass "
            "frozen_before=gc.get_freeze_count() taken before the pass"
        )
    expect(gc.isenabled(), "GC left disabled")
    frozen = gc.get_freeze_count()
    expect(frozen <= frozen_before, f"GC left frozen: {frozen} objects frozen, {frozen_before} before the pass")
    expect(manager.graphs == {}, f"graphs left registered: {list(manager.graphs)}")
    expect(manager.registry.captured == set(), f"keys left marked captured: {manager.registry.captured}")
    expect(manager.backend.graphs == (), "the backend still holds live graphs")
    expect(manager.backend.memory_in_use() == 0, f"the backend holds {manager.backend.memory_in_use()} bytes")


class Snapshot(NamedTuple):
    host: np.ndarray
    kv_cache: torch.Tensor
    stats: dict


def snapshot(manager: CaptureManager) -> Snapshot:
    return Snapshot(manager.buffers.packed_host.copy(), kv_cache(manager).clone(), manager.stats.as_dict())


def assert_unchanged(manager: CaptureManager, before: Snapshot, *, buffers: bool = True) -> None:
    """KV cache (and, with `buffers`, the staging buffers) byte-identical, and no step counted."""
    same = not buffers or np.array_equal(manager.buffers.packed_host, before.host)
    expect(same, "a refused batch wrote the persistent buffers")
    expect(torch.equal(kv_cache(manager), before.kv_cache), "a refused batch wrote the KV cache")
    expect(manager.stats.as_dict() == before.stats, "a refused batch was counted as a step")


class Hostile(NamedTuple):
    """A batch that must be refused: its arguments, and the message naming field and index."""

    name: str
    args: tuple
    match: str
    """Regex the error message must match (names the field, and the request index if any)."""


def hostile_batches(config: CaptureConfig) -> list[Hostile]:
    """Hostile steps for `config` (TINY): each is refused by `StepBatch` or by staging."""
    vocab, nb = config.model.vocab_size, config.kv_cache.num_blocks
    mml, bs = config.kv_cache.max_model_len, config.kv_cache.block_size
    seqs, tokens = config.batching.max_num_seqs, config.batching.max_num_tokens
    width = config.kv_cache.max_blocks_per_req
    bt = [[1, 2], [3, 4]]
    return [
        Hostile("token id = vocab_size", ([1, 2], [5, 6], [1, vocab, 2], bt), rf"input_ids\[1\] \(request 1\) is {vocab}"),
        Hostile("token id far above vocab", ([2, 1], [5, 6], [1, 2, 10**6], bt), r"input_ids\[2\] \(request 1\)"),
        Hostile("negative token id", ([2, 1], [5, 6], [1, -3, 2], bt), r"input_ids\[1\] is -3"),
        Hostile("token id above int32", ([1, 1], [5, 6], [1, 2**40], bt), r"input_ids holds \d+, above the int32"),
        Hostile("negative query_len", ([1, -2], [5, 6], None, bt), r"query_lens\[1\] is -2"),
        Hostile("zero query_len", ([0, 1], [5, 6], None, bt), r"query_lens\[0\] is 0"),
        Hostile("negative seq_len", ([1, 1], [5, -6], None, bt), r"seq_lens\[1\] is -6"),
        Hostile("seq_len below query_len", ([1, 3], [5, 2], None, bt), r"seq_lens\[1\] is 2 but query_lens\[1\] is 3"),
        Hostile("seq_len above int32", ([1, 1], [5, 2**33], None, bt), r"seq_lens\[1\] is \d+, above the int32"),
        Hostile("seq_len above max_model_len", ([1, 1], [5, mml + 1], None, [[1] * width] * 2), rf"seq_lens\[1\] is {mml + 1}, above max_model_len"),
        Hostile("huge seq_len in a big block table", ([1], [10**6], None, [[1] * width]), r"seq_lens\[0\] is 1000000, above max_model_len"),
        Hostile("block id = num_blocks", ([1, 1], [5, 6], None, [[1, 2], [3, nb]]), rf"block_table\[1, 1\] is {nb}, outside the KV cache"),
        Hostile("negative block id", ([1, 1], [5, 6], None, [[1, -1], [3, 4]]), r"block_table\[0, 1\] is -1"),
        Hostile("block id above int32", ([1, 1], [5, 6], None, [[1, 2**35], [3, 4]]), r"block_table holds \d+, above the int32"),
        Hostile("block table too narrow", ([1, 1], [5, 3 * bs], None, bt), r"request 1 has seq_len 12, which needs 3 blocks.*block_table has 2 columns"),
        Hostile("block table too wide", ([1], [5], None, [[1] * (width + 1)]), rf"block_table has {width + 1} columns"),
        Hostile("more requests than max_num_seqs", ([1] * (seqs + 1), [3] * (seqs + 1), None, None), rf"{seqs + 1} requests, above batching\.max_num_seqs"),
        Hostile("more tokens than max_num_tokens", ([tokens + 1], [tokens + 1], None, None), rf"{tokens + 1} tokens, above batching\.max_num_tokens"),
        Hostile("fewer seq_lens than query_lens", ([1, 1, 1], [5, 6], None, None), r"seq_lens has 2 entries but query_lens has 3"),
        Hostile("too few token ids", ([2, 1], [5, 6], [1, 2], bt), r"input_ids has 2 entries but query_lens sum to 3"),
        Hostile("block table rows != requests", ([1, 1], [5, 6], None, [[1, 2]]), r"block_table has 1 rows but the batch has 2"),
        Hostile("float query_lens", (np.array([1.0, 2.0]), [5, 6], None, bt), r"query_lens must hold integers; got dtype float64"),
        Hostile("float token ids", ([1, 1], [5, 6], np.array([1.0, 2.0]), bt), r"input_ids must hold integers"),
        Hostile("bool seq_lens", ([1, 1], np.array([True, True]), None, bt), r"seq_lens must hold integers; got dtype bool"),
        Hostile("string token ids", ([1, 1], [5, 6], ["a", "b"], bt), r"input_ids must hold integers"),
        Hostile("2-D query_lens", ([[1, 1]], [5, 6], None, bt), r"query_lens must be 1-D"),
        Hostile("1-D block table", ([1, 1], [5, 6], None, [1, 2]), r"block_table must be 2-D"),
        Hostile("ragged block table", ([1, 1], [5, 6], None, [[1, 2], [3]]), r"block_table rows have different lengths"),
        Hostile("uint64 above int32", (np.array([1, 1], np.uint64), np.array([5, 2**40], np.uint64), None, bt), r"seq_lens holds \d+, above the int32"),
        Hostile("int8 negative block id", ([1, 1], [5, 6], None, np.array([[1, -1], [3, 4]], np.int8)), r"block_table\[0, 1\] is -1"),
        Hostile("int16 negative token id", ([1, 1], [5, 6], np.array([7, -1], np.int16), bt), r"input_ids\[1\] is -1"),
        Hostile("byte-swapped negative token id", ([1, 1], [5, 6], np.array([7, -(2**31)], ">i4"), bt), r"input_ids\[1\] is -2147483648"),
    ]  # fmt: skip


# -- static inputs moved after capture ---------------------------------------------------------


class Move(NamedTuple):
    """A way an engine moves a static tensor after capture; `apply(manager)` does it."""

    name: str
    apply: Callable[[CaptureManager], None]
    match: str
    """Regex the `StaticInputMovedError` message must match (names the tensor); refused at every invariant level."""


def _replace_parameter(manager: CaptureManager) -> None:
    model = manager.model
    model.lm_head = torch.nn.Parameter(model.lm_head.detach().clone() * 2, requires_grad=False)


def _swap_data(manager: CaptureManager) -> None:
    with torch.no_grad():
        manager.model.lm_head.data = manager.model.lm_head.detach().clone()


def _set_storage(manager: CaptureManager) -> None:
    with torch.no_grad():
        manager.model.norm.set_(manager.model.norm.detach().clone())


def _replace_buffer(manager: CaptureManager) -> None:
    manager.model.kv_cache = manager.model.kv_cache.clone()


def _replace_submodule(manager: CaptureManager) -> None:
    import copy

    manager.model.layers[0] = copy.deepcopy(manager.model.layers[0])


def _register_again(manager: CaptureManager) -> None:
    manager.register_static("extra", torch.zeros(8))


def _write_parameters_dict(manager: CaptureManager) -> None:
    model = manager.model
    model._parameters["lm_head"] = torch.nn.Parameter(model.lm_head.detach() * 2, requires_grad=False)


def _write_buffers_dict(manager: CaptureManager) -> None:
    manager.model._buffers["rope_cos"] = manager.model.rope_cos * 2


MOVES = (
    Move("parameter replaced (model.lm_head = Parameter(...))", _replace_parameter, r"'model\.lm_head' was replaced"),
    Move("parameter storage swapped (lm_head.data = ...)", _swap_data, r"'model\.lm_head' moved after capture"),
    Move("parameter storage set_ (norm.set_(...))", _set_storage, r"'model\.norm' moved after capture"),
    Move("buffer replaced (model.kv_cache = ...)", _replace_buffer, r"'model\.kv_cache' was replaced"),
    Move("submodule replaced (model.layers[0] = ...)", _replace_submodule, r"'model\.layers\.0' was replaced"),
    Move("registered name given another tensor", _register_again, r"'static\.extra' was registered again"),
    Move("parameter written into _parameters", _write_parameters_dict, r"'model\.lm_head' was replaced"),
    Move("buffer written into _buffers", _write_buffers_dict, r"'model\.rope_cos' was replaced"),
)
"""The moves `StaticGuard` must refuse on the next replay (register `extra` before capture for the last)."""
