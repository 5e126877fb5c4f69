"""What graphcap reads off the model the engine brings, so the config's `model:` section need not repeat it.

A model built from the config (`model.factory` or the built-in `tiny-llama`) agrees with `model.*` by
construction; a model object passed to `CaptureManager` may not. Token ids are the one `model.*` field
graphcap itself relies on for any model (its dummy and probe batches draw ids in `[0, vocab_size)`, and the
invariants refuse ids past it), so the manager takes the model's own vocabulary when the model says it:

- an int attribute `vocab_size` on the model, or on its `config` (Hugging Face models);
- else the `nn.Embedding` returned by `get_input_embeddings()` (Hugging Face models);
- else the model's only `nn.Embedding` (with several, which one embeds tokens is not known: nothing is
  inferred, and a capture that fails indexing an embedding names `model.vocab_size`).

Also here: that the model's tensors are on the manager's device (`check_model_device`), whether the model
is graphcap's built-in one built from the config (`is_built_in`: the memory estimate's arithmetic holds for
it; any other model is measured), and its lowest floating precision.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from graphcap.config import CaptureConfig
from graphcap.errors import ConfigError, ConfigProblem

__all__ = ["VOCAB_HINT", "check_model_device", "is_built_in", "model_vocab_size", "precision_of", "with_model_vocab"]

log = logging.getLogger("graphcap")

VOCAB_HINT = (
    "graphcap's capture batches draw token ids in [0, model.vocab_size = {vocab}): if the model embeds fewer "
    "tokens, set model.vocab_size to its vocabulary (or give the model an int attribute vocab_size)"
)
"""Added to a capture failure that indexed out of range, when the vocabulary was not read off the model."""


def model_vocab_size(model: Any) -> tuple[int, str] | None:
    """The token ids `model` embeds and where that was read, or None when the model does not say."""
    config = getattr(model, "config", None)
    for where, value in (("vocab_size", getattr(model, "vocab_size", None)), ("config.vocab_size", _attr(config))):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, f"model.{where}"
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            embedding = getter()
        except (NotImplementedError, AttributeError):  # transformers' base class raises for models without one
            embedding = None
        if isinstance(embedding, torch.nn.Embedding):
            return embedding.num_embeddings, "model.get_input_embeddings()"
    if isinstance(model, torch.nn.Module):
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
        if len(found) == 1:
            name, embedding = found[0]
            return embedding.num_embeddings, f"model.{name} (its only nn.Embedding)" if name else "model"
    return None


def with_model_vocab(config: CaptureConfig, model: Any) -> tuple[CaptureConfig, bool]:
    """`config` with `model.vocab_size` set to the vocabulary `model` declares, and whether it was read off it.

    Unchanged (and False) when the model says nothing; a config whose value differs is corrected, with
    one log line naming both values.
    """
    found = model_vocab_size(model)
    if found is None:
        return config, False
    vocab, where = found
    if vocab != config.model.vocab_size:
        attribute = type(model).__name__ + where[len("model") :]  # `Qwen3ForCausalLM.config.vocab_size`
        log.info(
            "model.vocab_size: %d, read off the model object given to CaptureManager (%s); the config said %d",
            vocab,
            attribute,
            config.model.vocab_size,
        )
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))
    return config, True


def _attr(model_config: Any) -> Any:
    """`vocab_size` of a model's own `config` attribute (a Hugging Face config, say), or None."""
    if model_config is None or isinstance(model_config, (dict, list, tuple)):
        return None
    return getattr(model_config, "vocab_size", None)


def is_built_in(model: Any, config: CaptureConfig) -> bool:
    """`model` is graphcap's built-in model built from `config`'s shapes: the estimate's arithmetic holds for it."""
    from graphcap.models.llama import TinyLlama

    if not isinstance(model, TinyLlama):
        return False
    built = model.config
    return (
        config.model.factory is None
        and built.model == config.model
        and (built.kv_cache.block_size, built.kv_cache.max_model_len)
        == (config.kv_cache.block_size, config.kv_cache.max_model_len)
    )


def precision_of(model: Any) -> torch.dtype | None:
    """The lowest-precision floating dtype of `model`'s parameters (None: not a module, or none)."""
    if not isinstance(model, torch.nn.Module):
        return None
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)  # the largest epsilon


def check_model_device(model: Any, device: torch.device, given: bool) -> None:
    """`ConfigError` (key `device`) when a parameter or buffer of `model` is on another device than `device`.

    graphcap stages every step on `device` and never moves the model (`build_model` does, for the models it
    builds): a model left elsewhere would fail its first forward with torch's mixed-device error. 0-dim
    tensors are left out (torch lets a CPU scalar meet a CUDA tensor). `given`: `device` came from
    `CaptureManager(device=...)` rather than the config.
    """
    if not isinstance(model, torch.nn.Module):
        return
    tensors = ((f"parameter {n!r}", t) for n, t in model.named_parameters())
    buffers = ((f"buffer {n!r}", t) for n, t in model.named_buffers())
    for what, tensor in (*tensors, *buffers):
        if tensor.dim() and not _same_device(tensor.device, device):
            source = f"CaptureManager(device={str(device)!r})" if given else f"the config's device {str(device)!r}"
            there = tensor.device.type in ("cpu", "cuda")  # a device a config can name
            fix = f"pass device={str(tensor.device)!r}" if given else f"set device: {tensor.device}"
            raise ConfigError(
                [
                    ConfigProblem(
                        "device",
                        f"the model's {what} is on {tensor.device}, but graphcap stages every step on {device} "
                        f"({source}); move the model there before CaptureManager (model.to({str(device)!r}))"
                        + (f", or {fix}" if there else ""),
                    )
                ]
            )


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one (`cuda` is the current CUDA device)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
