"""Keys of one pass that probe the same counts probe the same batch, whose eager result is computed once.

A probe batch is drawn from its fill's counts, not from the key it probes (`probe_identity`), so one
real token is the same batch for every key, and the full batch of a smaller key is about half of a
larger one. Verification keeps each batch's eager result for the pass (`SharedReferences`) and
compares every later key's replay with it; a replay that differs from a kept result is compared again
with a fresh eager run, whose verdict stands. With peers nothing is kept.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import BufferSpec, CaptureError, CaptureManager, GraphKey, StepBatch
from graphcap.capture import capturer
from graphcap.capture import references as probing
from graphcap.models import build_model
from graphcap.probe import probe_batch, probe_fills, probe_identity
from graphcap.testing import Wrapped, make_config
from graphcap.testing.fuzz import Limits
from tests.axes_models import AXES, SlotLlama
from tests.axes_models import buffers as axes_buffers

SIZES = [1, 2, 4, 8]


class Counting(Wrapped):
    """The reference model, counting its forwards (`calls`); `scaled_at`: a key size whose steps the model scales
    by the Python token count, so that key's graph freezes the factor (its replay of a one-token probe is that
    many times the eager run, which scales by 1)."""

    def __init__(self, inner: torch.nn.Module, scaled_at: int | None = None) -> None:
        super().__init__(inner)
        self.scaled_at = scaled_at
        self.calls = 0

    def forward(self, inputs):
        self.calls += 1
        out = self.inner(inputs)
        return out * inputs.num_tokens if inputs.key.num_tokens == self.scaled_at else out


SCALED_AT_TWO = functools.partial(Counting, scaled_at=2)


def _manager(wrap=Counting, sizes=SIZES, **overrides) -> CaptureManager:
    torch.set_num_threads(1)
    config = make_config({"capture.sizes": sizes, **overrides})
    torch.manual_seed(0)
    return CaptureManager(wrap(build_model(config)), config, progress=False)


def _hits(monkeypatch) -> list[probing.SharedReferences]:
    """Every `SharedReferences` the passes make, to read their hits."""
    made = []
    init = probing.SharedReferences.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(probing.SharedReferences, "__init__", recording)
    return made


def _distinct(records) -> set:
    """The distinct probe batches of a pass's records (the pass's own key shapes, one phase, no axes)."""
    return {
        probe_identity(GraphKey(r.key.num_tokens, r.key.num_reqs, r.key.uniform), tuple(f))
        for r in records
        for f in r.verified_fills
    }


def test_keys_probed_at_the_same_counts_run_one_eager_run_per_batch(monkeypatch):
    made = _hits(monkeypatch)
    manager = _manager()
    report = manager.capture()
    assert report.records and all(r.status == "captured" and r.verified for r in report.records)
    probes = sum(len(r.verified_fills) for r in report.records)
    distinct = _distinct(report.records)
    assert len(distinct) < probes  # one token, at least, is probed by several keys
    (references,) = made
    assert references.hits == probes - len(distinct)
    # Per key a warmup and the recorded run (whose output checks the dummy batch's replay), and an eager run per
    # distinct probe batch.
    assert manager.model.calls == 2 * len(report.records) + len(distinct)
    assert not references.kept and references.bytes == 0  # dropped when the pass ended
    for record in report.records:  # every replay still matches eager at its fills
        assert record.verified_fills


def test_sharing_changes_no_verdict_and_no_replay(monkeypatch):
    shared, alone = _manager(), _manager()
    monkeypatch.setattr(capturer.SharedReferences, "for_pass", staticmethod(lambda peers, ledger: _off()))
    report_alone = alone.capture()
    monkeypatch.undo()
    report_shared = shared.capture()
    strip = lambda r: (r.key, r.status, r.verified, r.verified_fills)  # noqa: E731
    assert [strip(r) for r in report_shared.records] == [strip(r) for r in report_alone.records]
    assert shared.model.calls < alone.model.calls
    rng = np.random.default_rng(0)
    for size in (1, 3, 5, 8):
        q = np.ones(size, dtype=np.int32)
        batch = StepBatch(q, q + rng.integers(0, 20, size), rng.integers(1, 100, size))
        torch.testing.assert_close(shared.execute(batch).clone(), alone.execute(batch).clone())
        torch.testing.assert_close(shared.execute(batch).clone(), shared.eager(batch))


def _off() -> probing.SharedReferences:
    return probing.SharedReferences(False)


def _served(monkeypatch, change=lambda kept: kept) -> list[bool]:
    """Whether each lookup of a kept result found one; what it found is given as `change(kept)`."""
    get, served = probing.SharedReferences.get, []

    def serving(self, fingerprint):
        kept = get(self, fingerprint)
        served.append(kept is not None)
        return None if kept is None else change(kept)

    monkeypatch.setattr(probing.SharedReferences, "get", serving)
    return served


def test_a_replay_that_differs_from_a_kept_result_is_judged_by_a_fresh_eager_run(monkeypatch):
    made = _hits(monkeypatch)
    served = _served(monkeypatch, lambda kept: kept + 1.0)  # a kept result no replay matches
    manager = _manager()
    report = manager.capture()
    assert all(r.status == "captured" and r.verified for r in report.records)
    (references,) = made
    assert references.hits == 0 and any(served)  # every kept result missed; fresh eager runs decided
    assert manager.model.calls == 2 * len(report.records) + sum(len(r.verified_fills) for r in report.records)


def test_canary_a_wrong_graph_fails_on_a_batch_whose_result_was_kept(monkeypatch):
    made, served = _hits(monkeypatch), _served(monkeypatch)
    manager = _manager(SCALED_AT_TWO, sizes=[2, 8])
    with pytest.raises(CaptureError, match=r"replay differs from eager on .*1 of 2 tokens"):
        manager.capture()
    (references,) = made
    # Key 2's one-token probe was served key 8's kept result, missed it, and failed against a fresh eager run.
    assert served[-1] and sum(served) == references.hits + 1


class NoWriteAtTwo(Wrapped):
    """The reference model whose steps of some keys (default: two tokens) write every token's keys and values to
    the pad slot: their graphs never write the probe's slots, and read whatever they hold. `llama`: the wrapped
    module that holds the KV cache (`inner` itself, or its attribute)."""

    def __init__(self, inner: torch.nn.Module, broken=lambda key: key.num_tokens == 2, llama: str = "") -> None:
        super().__init__(inner)
        self.broken = broken
        self.llama = getattr(inner, llama) if llama else inner

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.llama.kv_cache

    def forward(self, inputs):
        if not self.broken(inputs.key):
            return self.inner(inputs)
        llama = self.llama
        paging = llama._paging

        def to_the_pad_slot(staged):
            slots, *rest = paging(staged)
            return (torch.full_like(slots, llama.num_slots), *rest)

        llama._paging = to_the_pad_slot
        try:
            return self.inner(inputs)
        finally:
            del llama._paging


def test_a_graph_that_never_writes_the_probes_slots_is_refused_with_scratch_blocks():
    # Probe batches that write scratch are each key's own: one shared with a larger key would find the right keys
    # and values in its slots already.
    manager = _manager(NoWriteAtTwo, **{"capture.on_error": "skip"})
    report = manager.capture(scratch_blocks=range(40, 72))
    status = {(r.key.num_tokens, r.key.uniform): r.status for r in report.records}
    assert {k: v for k, v in status.items() if v != "captured"} == {(2, True): "skipped", (2, False): "skipped"}


def test_keys_that_differ_only_in_an_axis_value_write_their_own_probe_batches():
    broken = lambda key: dict(key.axes).get("lora") == 2 and key.num_tokens > 1  # noqa: E731
    config = make_config({"capture.axes": AXES, "capture.sizes": [2, 4], "capture.on_error": "skip"})
    torch.manual_seed(0)
    model = NoWriteAtTwo(SlotLlama(config), broken, llama="llama")
    manager = CaptureManager(model, config, progress=False, buffers=axes_buffers())
    report = manager.capture(scratch_blocks=range(40, 72))
    refused = {r.key for r in report.records if r.status != "captured"}
    assert refused == {r.key for r in report.records if broken(r.key)} and len(refused) == 4


def test_probe_batches_that_write_are_each_keys_own_and_the_others_shared():
    limits = Limits.of(make_config())
    fill = probe_fills(GraphKey(8, 8, True), max_model_len=limits.max_model_len)[0]  # one token
    common = {**limits.probe_sizes, "fill": fill}
    keys = (GraphKey(8, 8, True), GraphKey(4, 4, False))
    for scratch, shared in (((), True), (tuple(range(40, 72)), False)):
        (a, writes), (b, _) = (probe_batch(key, scratch_blocks=scratch, **common) for key in keys)
        assert writes is not shared
        assert (probing.batch_fingerprint(a) == probing.batch_fingerprint(b)) is shared


@pytest.mark.parametrize(("sample", "shared"), [(None, True), (lambda rng, rows: rng.uniform(0.5, 1.5, rows), False)])
def test_an_engine_buffer_with_its_own_sampler_makes_every_probe_the_keys_own(monkeypatch, sample, shared):
    # An engine's sampler may name state rows the step writes and reads back (as the KV slots): like a batch that
    # writes, each key's probes are its own. A float buffer sampled around its pad names nothing: shared.
    made = _hits(monkeypatch)
    spec = BufferSpec("temperature", "reqs", dtype="float32", pad=1.0, sample=sample)
    config = make_config({"capture.sizes": SIZES})
    manager = CaptureManager(Counting(build_model(config)), config, progress=False, buffers=[spec])
    report = manager.capture()
    assert all(r.verified for r in report.records)
    (references,) = made
    assert (references.hits > 0) is shared
    probes = sum(len(r.verified_fills) for r in report.records)
    assert (manager.model.calls == 2 * len(report.records) + probes) is not shared


def test_a_wrong_graph_is_skipped_and_the_others_verified_with_on_error_skip():
    manager = _manager(SCALED_AT_TWO, sizes=[2, 8], **{"capture.on_error": "skip"})
    report = manager.capture()
    status = {(r.key.num_tokens, r.key.uniform): r.status for r in report.records}
    assert status == {(8, False): "captured", (8, True): "captured", (2, False): "skipped", (2, True): "skipped"}


def test_peers_keep_nothing():
    def built(peers) -> probing.SharedReferences:
        return probing.SharedReferences.for_pass(peers, None)

    assert built(None).enabled
    assert not built(object()).enabled
    references = built(object())
    references.expect({GraphKey(2, 2, True): ["a"], GraphKey(1, 1, True): ["a"]})
    references.keep(("a",), torch.ones(2), "a")
    assert references.get(("a",)) is None and not references.kept


def test_a_result_past_the_byte_limit_is_not_kept():
    references = probing.SharedReferences(True, limit=64)
    references.expect({GraphKey(2, 2, True): ["small", "large"], GraphKey(1, 1, True): ["small", "large"]})
    references.keep(("small",), torch.ones(4), "small")  # 16 bytes
    references.keep(("large",), torch.ones(32), "large")  # 128 bytes
    assert set(references.kept) == {("small",)} and references.bytes == 16
    kept = references.get(("small",))
    assert kept is not None and kept.data_ptr() != torch.ones(4).data_ptr()


def test_a_result_is_kept_only_while_a_later_probe_reads_it():
    first, second = GraphKey(8, 8, True), GraphKey(4, 4, True)
    references = probing.SharedReferences(True)
    references.expect({first: ["twice", "once"], second: ["twice"]})
    references.keep(("once",), torch.ones(4), "once")  # no later probe: not kept
    references.done(first, "once")
    references.keep(("twice",), torch.ones(4), "twice")
    references.done(first, "twice")
    assert set(references.kept) == {("twice",)} and references.bytes == 16
    references.done(second, "twice")  # its last probe ran
    assert not references.kept and references.bytes == 0


def test_a_key_whose_probes_did_not_run_lets_its_batches_go():
    first, failed = GraphKey(8, 8, True), GraphKey(4, 4, True)
    references = probing.SharedReferences(True)
    references.expect({first: ["one token"], failed: ["one token", "two tokens"]})
    references.keep(("one token",), torch.ones(4), "one token")
    references.done(first, "one token")
    assert references.kept
    references.abandon(failed)  # its verification failed before its probes
    assert not references.kept and references.bytes == 0 and sum(references.uses.values()) == 0
    references.done(failed, "one token")  # nothing left to count off
    assert sum(references.uses.values()) == 0


def test_a_skipped_key_leaves_no_result_held(monkeypatch):
    clear, at_end = probing.SharedReferences.clear, []

    def ending(self):
        at_end.append((len(self.kept), sum(self.uses.values()), self.hits))
        clear(self)

    monkeypatch.setattr(probing.SharedReferences, "clear", ending)
    manager = _manager(SCALED_AT_TWO, sizes=[2, 8], **{"capture.on_error": "skip"})
    report = manager.capture()
    assert {r.status for r in report.records} == {"captured", "skipped"}
    # Before the pass drops what it kept: nothing held, no probe left to come (the skipped keys' counted off).
    assert at_end == [(0, 0, at_end[0][2])] and at_end[0][2] > 0


def test_a_pass_holds_no_result_past_its_last_probe(monkeypatch):
    keep, held = probing.SharedReferences.keep, []

    def watched(self, fingerprint, output, made):
        before = len(self.kept)
        keep(self, fingerprint, output, made)
        held.append((self.uses[made], len(self.kept) > before, len(self.kept)))

    monkeypatch.setattr(probing.SharedReferences, "keep", watched)
    made = _hits(monkeypatch)
    manager = _manager(sizes=[1, 2, 3, 4, 5, 6, 7, 8])
    report = manager.capture()
    assert all(r.verified for r in report.records)
    (references,) = made
    assert all(uses > 1 for uses, grew, _ in held if grew)  # kept only for a later probe of its batch
    assert any(grew for _, grew, _ in held) and any(not grew for _, grew, _ in held)
    assert references.hits > max(count for _, _, count in held)  # fewer held at once than were served
    assert not references.kept and sum(references.uses.values()) == 0  # every expected probe ran


@given(
    T=st.integers(1, 32),
    R=st.integers(1, 8),
    uniform=st.booleans(),
    T2=st.integers(1, 32),
    R2=st.integers(1, 8),
    uniform2=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_two_keys_probe_the_same_batch_exactly_when_their_fills_have_one_identity(T, R, uniform, T2, R2, uniform2):
    limits = Limits.of(make_config())
    keys = []
    for t, r, u in ((T, R, uniform), (T2, R2, uniform2)):
        r = min(r, t)
        keys.append(GraphKey(t - t % r if u else t, r, u))
    batches = {}
    for key in keys:
        for fill in probe_fills(key, max_model_len=limits.max_model_len):
            batch, writes = probe_batch(
                key,
                **limits.probe_sizes,
                fill=fill,
            )
            fingerprint = probing.batch_fingerprint(batch, "full", writes)
            identity = probe_identity(key, fill)
            assert (batch.num_tokens, batch.num_reqs) == fill
            if identity in batches:
                assert batches[identity] == fingerprint
            batches[identity] = fingerprint
    assert len(set(batches.values())) == len(batches)  # another identity, another batch


def test_a_fingerprint_tells_every_value_of_a_batch():
    q, s = np.array([1, 2]), np.array([3, 5])
    base = StepBatch(q, s, np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), extras={"t": [0.5, 1.0]})
    same = StepBatch(q.copy(), s.copy(), np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), extras={"t": [0.5, 1.0]})
    fingerprint = probing.batch_fingerprint
    assert fingerprint(base, "full") == fingerprint(same, "full")
    assert fingerprint(base, "full") != fingerprint(base, "eager")
    others = [
        StepBatch(q, np.array([3, 6]), np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), extras={"t": [0.5, 1.0]}),
        StepBatch(q, s, np.array([1, 2, 4]), np.array([[1, 2], [3, 4]]), extras={"t": [0.5, 1.0]}),
        StepBatch(q, s, np.array([1, 2, 3]), np.array([[1, 2], [3, 5]]), extras={"t": [0.5, 1.0]}),
        StepBatch(q, s, np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), extras={"t": [0.5, 2.0]}),
        StepBatch(q, s, np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), extras={"t": [0.5, 1.0]}, axes={"a": 1}),
        StepBatch(q, s, np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), kv_groups={"g": [[1], [2]]}),
    ]
    assert len({fingerprint(b, "full") for b in [base, *others]}) == len(others) + 1
