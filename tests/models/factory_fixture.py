"""Factories for `build_model` tests, imported by dotted path (`model.factory`)."""

from __future__ import annotations

import torch
from torch import nn

NOT_CALLABLE = 42


class Bigram(nn.Module):
    """A tiny model that honours the protocol: logits from the current token only."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        table = torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(0))
        self.table = nn.Parameter(table, requires_grad=False)

    def forward(self, inputs) -> torch.Tensor:
        return self.table.index_select(0, inputs.input_ids)  # logits: [T, vocab]


def make_bigram(config) -> Bigram:
    return Bigram(config.model.vocab_size)


def make_junk(config) -> object:
    return [1, 2, 3]


class _NoForward:
    forward = "not a method"


def make_no_forward(config) -> object:
    return _NoForward()


class Configured(nn.Module):
    """A factory model that reads its own settings from `model.options` and builds on `device`."""

    def __init__(self, config, device) -> None:
        super().__init__()
        options = config.model.options
        self.scale = float(options["scale"])
        self.built_on = torch.device(device)
        table = torch.randn(config.model.vocab_size, options["width"], generator=torch.Generator().manual_seed(0))
        self.table = nn.Parameter(table.to(device), requires_grad=False)

    def forward(self, inputs) -> torch.Tensor:
        return self.table.index_select(0, inputs.input_ids) * self.scale


def make_configured(config, *, device) -> Configured:
    return Configured(config, device)


class WithScale(nn.Module):
    """A factory model that wraps the built-in model: its logits times `model.options["scale"]`."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, inputs) -> torch.Tensor:
        return self.inner(inputs) * self.scale


def make_wrapped(config) -> WithScale:
    from graphcap.models import build_model

    return WithScale(build_model(config), float(config.model.options.get("scale", 2.0)))


SEEN_DEVICES: list[str] = []
"""`config.device` as each call of `make_seeing` saw it."""


def make_seeing(config) -> Bigram:
    SEEN_DEVICES.append(config.device)
    return Bigram(config.model.vocab_size)
