"""Which rows of a step's result are real: `model.output_rows` declares them, no ambiguous shape is guessed.

The case it guards: a forward returning one row per request (`logits[query_start_loc[1:] - 1]`,
as engines sample) replays a key with as many request rows as tokens (8 and 8); cut as per token,
a 2-request 5-token prefill came back as 5 rows from `execute` and 2 from `eager`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import CaptureError, CaptureManager, GraphKey, StepBatch
from graphcap.models import build_model
from graphcap.outputs import OutputRows
from graphcap.testing import make_config

PREFILL = StepBatch([3, 2], [3, 2], [5, 6, 7, 8, 9], [[1], [2]])  # 2 requests, 5 tokens: key (8 tokens, 8 reqs)


class Sampled(torch.nn.Module):
    """The reference model, returning per-token hidden rows and per-request logits (each request's last token)."""

    def __init__(self, config, output_rows=None, shape: str = "dict") -> None:
        super().__init__()
        self.inner, self.shape = build_model(config), shape
        if output_rows is not None:
            self.output_rows = output_rows

    def forward(self, inputs):
        logits = self.inner(inputs)  # [T, vocab]
        last = logits.index_select(0, (inputs.query_start_loc[1:] - 1).clamp(min=0))  # [R, vocab]
        hidden = logits[:, :16] * 2  # [T, 16]
        if self.shape == "tensor":
            return last
        if self.shape == "tuple":
            return hidden, last
        return {"hidden": hidden, "logits": last}


_MANAGERS: dict[str, CaptureManager] = {}


def declared_manager() -> CaptureManager:
    if "declared" not in _MANAGERS:
        config = make_config()
        model = Sampled(config, {"hidden": "tokens", "logits": "reqs"})
        manager = CaptureManager(model, config, progress=False)
        manager.capture()
        _MANAGERS["declared"] = manager
    return _MANAGERS["declared"]


def test_outputs_declared_per_request_are_cut_to_num_reqs_at_a_key_with_as_many_request_rows_as_tokens():
    manager = declared_manager()
    got = {name: t.clone() for name, t in manager.execute(PREFILL).items()}
    assert manager.last_key == GraphKey(8, 8, False)  # T == R: the shape alone cannot tell the rows apart
    assert got["logits"].shape == (2, 128) and got["hidden"].shape == (5, 16)
    want = manager.eager(PREFILL)
    torch.testing.assert_close(got, want)


@given(
    query_lens=st.lists(st.integers(1, 4), min_size=1, max_size=8).filter(lambda q: sum(q) <= 8), seed=st.integers(0, 9)
)
@settings(max_examples=25, deadline=None)
def test_declared_outputs_replay_equal_to_eager_for_any_batch(query_lens, seed):
    manager = declared_manager()
    q = np.array(query_lens)
    rng = np.random.default_rng(seed)
    seq = q + rng.integers(0, 6, len(q))
    blocks = np.arange(1, 1 + len(q) * 8).reshape(len(q), 8)
    batch = StepBatch(q, seq, rng.integers(0, 128, int(q.sum())), blocks)
    got = {name: t.clone() for name, t in manager.execute(batch).items()}
    assert got["logits"].shape[0] == batch.num_reqs and got["hidden"].shape[0] == batch.num_tokens
    torch.testing.assert_close(got, manager.eager(batch))


@pytest.mark.parametrize(
    ("shape", "output_rows", "rows"),
    [("tensor", "reqs", [2]), ("tuple", {1: "reqs"}, [5, 2]), ("tuple", {0: "tokens", 1: "reqs"}, [5, 2])],
)
def test_a_str_declares_every_tensor_and_positions_declare_a_tuples(shape, output_rows, rows):
    config = make_config(capture__sizes=[8])
    manager = CaptureManager(Sampled(config, output_rows, shape), config, progress=False)
    assert all(r.verified for r in manager.capture().records)
    got = manager.execute(PREFILL)
    got = (got,) if shape == "tensor" else got
    assert [t.shape[0] for t in got] == rows
    want = manager.eager(PREFILL)
    torch.testing.assert_close(tuple(t.clone() for t in got), (want,) if shape == "tensor" else want)


def test_an_undeclared_per_request_output_fails_verification_naming_the_declaration_to_write():
    config = make_config(capture__sizes=[8])
    manager = CaptureManager(Sampled(config), config, progress=False)
    with pytest.raises(
        CaptureError,
        match=r"output 'logits' has shape \(\d+, 128\) from the replay \(shape \(8, 128\), undeclared: cut to the "
        r"real tokens.*but \(\d+, 128\) from an eager run .*it is a row per request: declare it, "
        r"output_rows = \{'logits': 'reqs'\}",
    ):
        manager.capture()
    assert not manager.graphs


@pytest.mark.parametrize(
    ("overrides", "rows"),
    [({}, r"\(2, 128\); a 'tokens' output has a row per token, padded ones included: 4 rows here \(4 tokens, 2 requests\)"),
     ({"batching.max_num_seqs": 2}, r"\(2, 128\); a 'tokens' output has a row per token, padded ones included: 8 rows")],
)  # fmt: skip
def test_a_wrong_declaration_is_refused_at_capture(overrides, rows):
    # Key (8, 8): the replay's 8 rows fit 'tokens'; the eager run of a probe (4 tokens, 2 requests) shows it
    # wrong. Key (8, 2): the graph's own output has the wrong rows.
    config = make_config(overrides, capture__sizes=[8])
    manager = CaptureManager(Sampled(config, {"logits": "tokens"}), config, progress=False)
    with pytest.raises(
        CaptureError, match=r"output 'logits' is declared 'tokens' \(model.output_rows\) but has shape " + rows
    ):
        manager.capture()


@pytest.mark.parametrize(
    ("output_rows", "match"),
    [
        ({"hidden": "tokens"}, r"output 'logits' \(8, 128\) of mixed\(tokens=8, reqs=8\): 8 rows, the key's "
         r"padded request count and token count, so it could be per token or per request"),
        ({"hidden": "tokens", "logits": "reqs"}, None),
    ],
)  # fmt: skip
def test_with_verification_off_an_output_whose_shape_is_ambiguous_must_be_declared(output_rows, match):
    config = make_config(capture__sizes=[8], checks__verify_replay=False)
    manager = CaptureManager(Sampled(config, output_rows), config, progress=False)
    if match is None:
        manager.capture()  # declared: nothing to guess
        got = {name: t.clone() for name, t in manager.execute(PREFILL).items()}
        torch.testing.assert_close(got, manager.eager(PREFILL))
        return
    with pytest.raises(CaptureError, match=match + r".*Declare it, output_rows = \{'logits': 'tokens' \| 'reqs'\}"):
        manager.capture()


def test_the_reference_model_declares_its_logits_per_token_and_captures_without_verification():
    config = make_config(capture__sizes=[8], checks__verify_replay=False)
    model = build_model(config)
    assert model.output_rows == "tokens"
    manager = CaptureManager(model, config, progress=False)
    manager.capture()
    torch.testing.assert_close(manager.execute(PREFILL).clone(), manager.eager(PREFILL))


@pytest.mark.parametrize(
    ("output_rows", "match"),
    [
        ("req", r"model.output_rows is 'req'; model.output_rows is 'tokens', 'reqs' or 'none'"),
        ({"logits": "rows"}, r"model.output_rows\['logits'\] is 'rows'"),
        ({True: "reqs"}, r"model.output_rows\[True\] is 'reqs'"),
        (["tokens"], r"model.output_rows is a list"),
    ],
)
def test_a_bad_declaration_is_refused_when_the_manager_is_made(output_rows, match):
    config = make_config(capture__sizes=[8])
    with pytest.raises(ValueError, match=match):
        CaptureManager(Sampled(config, output_rows), config, progress=False)


def test_a_declaration_naming_an_output_the_result_lacks_is_refused():
    config = make_config(capture__sizes=[8])
    manager = CaptureManager(Sampled(config, {"logit": "reqs"}), config, progress=False)
    with pytest.raises(
        CaptureError, match=r"declares 'logit', which the forward's result does not have: .*'hidden', 'logits'"
    ):
        manager.capture()
    with pytest.raises(CaptureError, match=r"declares 'logit'"):
        manager.eager(PREFILL)


def test_undeclared_outputs_are_cut_only_where_their_shape_says_so():
    rows = OutputRows()
    config = make_config()
    model = build_model(config)
    manager = CaptureManager(model, config, progress=False)
    inputs = manager.buffers.stage(PREFILL, GraphKey(8, 4, False))  # T = 8, R = 4, 5 tokens, 2 requests
    out = rows.real({"t": torch.zeros(8, 3), "r": torch.zeros(4), "w": torch.zeros(3), "s": torch.zeros(())}, inputs)
    assert {k: tuple(v.shape) for k, v in out.items()} == {"t": (5, 3), "r": (4,), "w": (3,), "s": ()}
    assert rows.ambiguity({"r": torch.zeros(4)}, GraphKey(8, 4, False)) is not None  # per request, or whole?
    assert rows.ambiguity({"t": torch.zeros(8)}, GraphKey(8, 4, False)) is None
    assert rows.ambiguity(torch.zeros(4), GraphKey(4, 4, True)) is None  # decode: as many tokens as requests
    assert rows.ambiguity(torch.zeros(4), GraphKey(4, None, False)) is None  # piecewise: no padded requests


@given(
    T=st.integers(1, 16),
    R=st.integers(1, 16),
    data=st.data(),
    kinds=st.lists(st.sampled_from(["tokens", "reqs", "none"]), min_size=1, max_size=4),
)
@settings(max_examples=200, deadline=None)
def test_declared_tensors_are_cut_to_their_real_rows_whatever_the_counts(T, R, data, kinds):
    n, r = data.draw(st.integers(0, T)), data.draw(st.integers(0, R))
    whole = [data.draw(st.integers(1, 20)) for _ in kinds]
    inputs = SimpleNamespace(input_ids=torch.zeros(T), seq_lens=torch.zeros(R), num_tokens=n, num_reqs=r)
    rows = {"tokens": T, "reqs": R}
    result = tuple(torch.zeros(rows.get(kind, k), 2) for kind, k in zip(kinds, whole))
    cut = OutputRows(dict(enumerate(kinds))).real(result, inputs)
    assert [t.shape[0] for t in cut] == [{"tokens": n, "reqs": r}.get(kind, k) for kind, k in zip(kinds, whole)]
    assert all(c.data_ptr() == t.data_ptr() for c, t in zip(cut, result) if c.numel())  # views, no copy
    undeclared = OutputRows().real(result, inputs)  # by shape: T rows are tokens, anything else whole
    assert [t.shape[0] for t in undeclared] == [n if t.shape[0] == T else t.shape[0] for t in result]
