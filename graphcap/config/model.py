"""The `model:` section: a built-in reference model or an importable factory, and its shape."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal

from graphcap.config._schema import Section, problem, spec
from graphcap.errors import ConfigProblem

__all__ = ["BUILTIN_MODELS", "ModelConfig"]

BUILTIN_MODELS = ("tiny-llama",)
"""Names accepted by `model.name` (built by `graphcap.models.build_model`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(Section):
    """The model to capture: a built-in reference model or an importable factory."""

    _key: ClassVar[str] = "model"
    name: str | None = None
    """Built-in model (`tiny-llama`); the default when `factory` is not set either."""
    factory: str | None = None
    """`"pkg.module:function"`, called with the `CaptureConfig`; returns the model."""
    hidden_size: int = spec(256, min=1, max=1 << 16)
    """Width of the residual stream (at most 65536; the largest published models use 16384-25600)."""
    num_layers: int = spec(2, min=1, max=1 << 10)
    """Decoder layers (at most 1024)."""
    num_heads: int = spec(8, min=1, max=1 << 10)
    """Query heads; `hidden_size` must divide evenly among them (at most 1024)."""
    num_kv_heads: int = spec(2, min=1, max=1 << 10)
    """Key/value heads (grouped-query attention); must divide `num_heads`."""
    intermediate_size: int | None = spec(None, min=1, max=1 << 20)
    """SwiGLU width; null means 8/3 of hidden_size rounded up to a multiple of 64 (at most 1048576)."""
    vocab_size: int = spec(4096, min=1, max=1 << 24)
    """Token ids are valid in `[0, vocab_size)` (at most 16777216; today's largest are ~256k)."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weight and activation dtype."""
    seed: int = spec(0, min=0, max=2**64 - 1)
    """Seed of the deterministic random weights (torch generators take 0 to 2**64 - 1)."""
    rope_theta: float = spec(10000.0, gt=0)
    """Rotary embedding base."""
    rms_norm_eps: float = spec(1e-5, gt=0)
    """RMSNorm epsilon."""
    attention: Literal["vectorized", "per_request"] = "vectorized"
    """Reference model only: `vectorized` paged attention (graph-safe), or `per_request`, a Python
    loop over requests with `.item()` lengths marked `graphcap.eager_op` (graph-unsafe; the
    vectorized path stands in for it inside full graphs): a model for the piecewise modes."""
    options: Mapping = field(default_factory=dict)
    """A factory model's own settings, passed through to it untouched (`config.model.options`):
    any mapping with string keys. graphcap reads none of it."""

    def __post_init__(self) -> None:
        Section.__post_init__(self)
        if self.name is None and self.factory is None:
            object.__setattr__(self, "name", BUILTIN_MODELS[0])
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # read-only, like the rest

    def _check(self) -> list[ConfigProblem]:
        out = []
        if self.name is not None and self.factory is not None:
            out.append(
                problem(
                    "factory",
                    f"give model.name or model.factory, not both; got name {self.name!r} and factory {self.factory!r}",
                )
            )
        if self.name is not None and self.name not in BUILTIN_MODELS:
            out.append(
                problem(
                    "name",
                    f"unknown model {self.name!r}; built in: {', '.join(BUILTIN_MODELS)} "
                    '(or use model.factory: "pkg.module:function")',
                )
            )
        if self.factory is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.factory):
            out.append(problem("factory", f'must look like "pkg.module:function"; got {self.factory!r}'))
        bad_keys = [k for k in self.options if not isinstance(k, str)]
        if bad_keys:
            out.append(problem("options", f"keys must be strings; got {bad_keys[0]!r}"))
        if self.factory is not None:
            return out  # the shape rules below are the built-in model's; a factory model has its own
        if self.hidden_size % self.num_heads:
            out.append(
                problem("num_heads", f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            )
        elif (self.hidden_size // self.num_heads) % 2:
            out.append(
                problem(
                    "num_heads",
                    f"head size {self.hidden_size // self.num_heads} (hidden_size / num_heads) "
                    "must be even for rotary embeddings",
                )
            )
        if self.num_heads % self.num_kv_heads:
            out.append(
                problem(
                    "num_kv_heads", f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
                )
            )
        return out

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """`intermediate_size`, or its default: 8/3 of hidden_size rounded up to 64."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64
