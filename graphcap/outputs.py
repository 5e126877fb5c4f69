"""What a forward returns, and how a step's result is cut to its real rows.

A forward returns a tensor, a tuple or list of tensors, or a dict of tensors by name
(`flatten_output` is that contract, shared by the backends and the manager). `real_rows` cuts
a result's token-row tensors (leading dim the padded token count) to the real tokens; other
tensors come back whole. `cloned` copies every tensor of a result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphcap.errors import CaptureError

__all__ = ["cloned", "flatten_output", "real_rows"]


def flatten_output(
    output: Any, name: str, what: str = "the forward captured as"
) -> tuple[list[torch.Tensor], Callable[[list], Any]]:
    """The tensors of a forward's result, and how to rebuild the result's structure from them.

    A forward returns a tensor, a tuple or list of tensors, or a dict of tensors by name
    (hidden states and logits, say). Anything else is a `CaptureError` saying what it returned.
    """
    if isinstance(output, torch.Tensor):
        return [output], lambda leaves: leaves[0]
    if isinstance(output, (tuple, list)) and output and all(isinstance(t, torch.Tensor) for t in output):
        kind = type(output)
        return list(output), lambda leaves: kind(leaves)
    if isinstance(output, dict) and output and all(isinstance(t, torch.Tensor) for t in output.values()):
        keys = list(output)
        return list(output.values()), lambda leaves: dict(zip(keys, leaves))
    raise CaptureError(
        f"{what} {name} returned {_describe(output)}; it must return a torch.Tensor, "
        "a tuple or list of tensors, or a dict of tensors (e.g. {'hidden': h, 'logits': logits})"
    )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list, dict)):
        items = value.values() if isinstance(value, dict) else value
        kinds = sorted({type(v).__name__ for v in items})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__


def real_rows(output: Any, num_tokens: int, padded: int, what: str = "the forward of") -> Any:
    """`output` (a tensor, or a tuple, list or dict of them) with token-row tensors cut to the real rows.

    A tensor whose leading dim is the padded token count is cut to `[:num_tokens]`; any other
    tensor (a per-request or pooled result) is returned whole.
    """
    leaves, rebuild = flatten_output(output, "this step", what)
    return rebuild([t[:num_tokens] if t.dim() and t.shape[0] == padded else t for t in leaves])


def cloned(output: Any) -> Any:
    """A copy of every tensor of `output`, in the same structure."""
    leaves, rebuild = flatten_output(output, "this step", "the forward of")
    return rebuild([t.clone() for t in leaves])
