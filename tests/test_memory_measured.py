"""The budget holds the model that is there: a model graphcap has no arithmetic for is measured.

The rules: a model object (or a `model.factory` model) is held to `capture.memory_budget` by each key's
graph memory measured on it (one eager forward of the key's dummy batch: on the emulated backend the
exact allocation peak, and the bytes of what it returns), not by the built-in model's arithmetic from
`model.*`; a factory model and a model object get the same decision; the built-in model built from the
config keeps the arithmetic, which the measurement agrees with.
"""

from __future__ import annotations

import torch

from graphcap import CaptureManager
from graphcap.memory.budget import MemoryBudget
from graphcap.models import build_model
from graphcap.testing import make_config

VOCAB = 32  # the model's own logits width; the config's model.vocab_size is 128


class Small(torch.nn.Module):
    """Logits of `VOCAB` per token, float32: each key's output is `T * VOCAB * 4` bytes."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, inputs):
        return self.out(self.embed(inputs.input_ids.long()))


class Wrapped(torch.nn.Module):
    """The built-in model behind a wrapper: graphcap cannot tell it is the built-in one, so it measures."""

    output_rows = "tokens"

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs):
        return self.inner(inputs)


def _captured(model, config) -> tuple[set, dict]:
    manager = CaptureManager(model, config, progress=False)
    report = manager.capture()
    return set(manager.graphs), report.memory_budget


def test_a_model_object_is_held_to_the_budget_by_its_own_graphs():
    config = make_config()
    manager = CaptureManager(Small(), config, progress=False)
    order = manager.registry.capture_order()
    budget = sum(key.num_tokens * VOCAB * 4 for key in order[:3])  # the three largest keys' outputs, exactly
    graphs, entry = _captured(Small(), make_config(capture__memory_budget=budget))
    assert graphs == set(order[:3])
    assert entry["estimate_bytes"] == budget
    # The canary: by the built-in arithmetic (128 logits a token, from model.vocab_size) fewer keys fit.
    arithmetic = MemoryBudget(config, "emulated")
    assert arithmetic.estimate(config, order[:2]) > budget


def test_a_factory_model_and_a_model_object_get_the_same_decision():
    budget = 3 * 16 * VOCAB * 4
    plain = _captured(Small(), make_config(capture__memory_budget=budget))
    factory = _captured(Small(), make_config({"capture.memory_budget": budget, "model.factory": "pkg.mod:make"}))
    assert plain == factory and plain[0]


def test_the_built_in_model_measured_agrees_with_its_arithmetic():
    config = make_config()
    measured = CaptureManager(Wrapped(build_model(config)), config, progress=False)
    keys = measured.registry.capture_order()
    for key in keys[:2]:
        graph = measured._budget._costs(config, [key])[key]
        assert graph.output == key.num_tokens * config.model.vocab_size * 4  # float32 logits per token
        assert graph.activations > 0
    arithmetic = MemoryBudget(config, "emulated")
    assert measured._budget.estimate(config, keys) == arithmetic.estimate(config, keys)


def test_the_built_in_model_built_from_the_config_is_not_measured():
    config = make_config(capture__memory_budget="1GiB")
    manager = CaptureManager(build_model(config), config, progress=False)
    assert manager._budget.measure is None
    assert CaptureManager(Small(), config, progress=False)._budget.measure is not None
