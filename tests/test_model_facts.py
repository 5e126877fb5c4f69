"""The model the engine brings sets `model.vocab_size`: the config's `model:` section need not repeat it.

The rules: a model that declares its vocabulary (a `vocab_size` attribute, `config.vocab_size`,
`get_input_embeddings()`, or its only `nn.Embedding`) replaces the config's `model.vocab_size`, so
capture's batches draw valid ids and the invariants check the model's bound; a model that does not
say, and fails capture indexing out of range, gets an error naming `model.vocab_size`.
"""

from __future__ import annotations

import types

import pytest
import torch

from graphcap import BatchError, CaptureError, CaptureManager, StepBatch
from graphcap.model_facts import model_vocab_size
from graphcap.testing import make_config

VOCAB = 64  # the models' own vocabulary; the config says 128 (TINY's)


class Embedder(torch.nn.Module):
    """A small token model: embedding, one linear layer; logits per token."""

    def __init__(self, extra_embedding: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.nn.Embedding(VOCAB, 16)
        self.tokens.weight.data = torch.randn(VOCAB, 16, generator=gen)
        self.out = torch.nn.Linear(16, VOCAB)
        if extra_embedding:  # a second embedding (positions): which one embeds tokens is not known
            self.where = torch.nn.Embedding(4096, 16)

    def forward(self, inputs):
        return self.out(self.tokens(inputs.input_ids.long()))


def test_a_model_with_one_embedding_sets_the_vocabulary_and_captures():
    config = make_config()
    assert config.model.vocab_size > VOCAB
    manager = CaptureManager(Embedder(), config, progress=False)
    assert manager.config.model.vocab_size == VOCAB
    report = manager.capture()
    assert report.records and all(record.verified for record in report.records)
    batch = StepBatch([2, 1], [3, 4], [5, 63, 7], [[1], [2]])
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))
    with pytest.raises(BatchError, match=rf"input_ids\[0\] .* is {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"):
        manager.execute(StepBatch([1], [2], [VOCAB], [[1]]))  # the model's bound, not the config's


def test_a_model_that_does_not_say_fails_capture_naming_model_vocab_size():
    config = make_config(capture__sizes=[8])
    manager = CaptureManager(Embedder(extra_embedding=True), config, progress=False)
    assert manager.config.model.vocab_size == config.model.vocab_size  # nothing inferred
    with pytest.raises(CaptureError, match=r"IndexError: index out of range.*model\.vocab_size = 128\)"):
        manager.capture()


def test_the_same_model_captures_once_it_declares_its_vocabulary():
    model = Embedder(extra_embedding=True)
    model.vocab_size = VOCAB  # the canary's fix: the model says it
    manager = CaptureManager(model, make_config(capture__sizes=[8]), progress=False)
    assert manager.capture().records[0].verified


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (types.SimpleNamespace(vocab_size=300), (300, "model.vocab_size")),
        (types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=512)), (512, "model.config.vocab_size")),
        (
            types.SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(77, 2)),
            (77, "model.get_input_embeddings()"),
        ),
        (Embedder(), (VOCAB, "model.tokens (its only nn.Embedding)")),
        (Embedder(extra_embedding=True), None),
        (types.SimpleNamespace(vocab_size=True), None),  # not a count
        (types.SimpleNamespace(config={"vocab_size": 9}), None),  # a dict config is not read
        (object(), None),
    ],
)
def test_where_the_vocabulary_is_read(model, expected):
    assert model_vocab_size(model) == expected


def test_a_built_in_model_keeps_the_configs_vocabulary():
    from graphcap.models import build_model

    config = make_config()
    manager = CaptureManager(build_model(config), config, progress=False)
    assert manager.config == config


def test_the_log_line_says_the_vocabulary_was_read_off_the_model_object_and_where(caplog):
    with caplog.at_level("INFO", logger="graphcap"):
        CaptureManager(Embedder(), make_config(), progress=False)
    assert (
        "model.vocab_size: 64, read off the model object given to CaptureManager "
        "(Embedder.tokens (its only nn.Embedding)); the config said 128"
    ) in caplog.messages
