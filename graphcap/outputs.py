"""What a forward returns, and which rows of a step's result are real.

A forward returns a tensor, a tuple or list of tensors, or a dict of tensors by name
(`flatten_output` is that contract, shared by the backends and the manager). `OutputRows`
cuts a step's result to its real rows, as the model declares them in `model.output_rows`,
with the vocabulary of `BufferSpec.rows`:

| declared | rows of the tensor | cut to |
|---|---|---|
| `"tokens"` | one per padded token (`T`) | the real tokens `[:num_tokens]` |
| `"reqs"` | one per padded request (`R`) | the real requests `[:num_reqs]` |
| `"none"` | any | nothing: the whole tensor |

A str declares every tensor of the result; a dict declares tensors by name (a dict result) or
by position (a tuple or list result). A tensor that is not declared is cut only where its
shape says which it is: `T` rows at a key whose `R` differs are per token; rows that are
neither `T` nor `R` are whole. `R` rows are ambiguous (per request, or per token when
`T == R`, or whole): such a tensor is cut as if per token when it has `T` rows and given whole
otherwise, and capture proves that right on the probe batch, whose token and request counts
differ (`checks.verify_replay`), or, with verification off, refuses the key (`ambiguity`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from graphcap.errors import CaptureError
from graphcap.inputs import ForwardInputs
from graphcap.keys import GraphKey
from graphcap.torch_modes import no_torch_function

__all__ = ["ROW_KINDS", "OutputRows", "StepOutput", "cloned", "flatten_output"]

StepOutput = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]
"""What a forward returns and a step gives back: a tensor, a tuple or list of tensors, or a dict of them by name."""

ROW_KINDS = ("tokens", "reqs", "none")
"""What one output tensor's rows are (`model.output_rows`), as `BufferSpec.rows`."""


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


def cloned(output: Any) -> Any:
    """A copy of every tensor of `output`, in the same structure."""
    leaves, rebuild = flatten_output(output, "this step", "the forward of")
    return rebuild([t.clone() for t in leaves])


class OutputRows:
    """A model's `output_rows` declaration, checked once, and the cut of each step's result by it.

    Does not copy: the cut tensors are views of the result (of a graph's static output on replay).
    Does not guess where a shape is ambiguous: see the module docstring.
    """

    def __init__(self, declared: str | Mapping[str | int, str] | None = None) -> None:
        self.declared = _checked(declared)
        """A kind for every tensor (str), kinds by output name or position (dict), or None."""
        self._kinds: dict[Any, tuple[str | None, ...]] = {}  # by the result's names: each tensor's kind

    @classmethod
    def of(cls, model: Any) -> OutputRows:
        """The declaration of `model.output_rows` (absent: nothing declared)."""
        return cls(getattr(model, "output_rows", None))

    def real(self, output: Any, inputs: ForwardInputs, what: str = "the forward of") -> Any:
        """`output` (of a step staged as `inputs`) with each tensor cut to its real rows.

        `CaptureError` when a declared tensor does not have the rows it is declared with, or the
        declaration names an output the result does not have.
        """
        if type(output) is torch.Tensor and not isinstance(self.declared, dict):  # the common case
            with no_torch_function():  # shapes and a slice: an engine's torch modes need not see them
                return _cut(output, self.declared, None, _rows(inputs))
        with no_torch_function():
            rows = _rows(inputs)
        leaves, rebuild = flatten_output(output, "this step", what)
        kinds, names = self.kinds(output), _names(output)
        # Plain tensors are cut with torch function off; a subclass keeps its own __torch_function__ (and type).
        with no_torch_function() if all(type(t) is torch.Tensor for t in leaves) else contextlib.nullcontext():
            return rebuild([_cut(t, kind, name, rows) for t, kind, name in zip(leaves, kinds, names)])

    def kinds(self, output: Any) -> tuple[str | None, ...]:
        """The declared kind of each tensor of `output` (None: undeclared), in `flatten_output` order."""
        names = _names(output)
        kinds = self._kinds.get(names)
        if kinds is None:
            if len(self._kinds) > 64:  # results whose dict keys change every step: keep the cache small
                self._kinds.clear()
            kinds = self._kinds[names] = self._resolve(names, output)
        return kinds

    def ambiguity(self, output: Any, key: GraphKey) -> str | None:
        """Why an undeclared tensor of a graph's `output` at `key` has a shape that does not say its cut, or None.

        A tensor with the key's `R` padded request rows could be per request, or per token (when
        `T == R`), or whole (when `T != R`); the cuts differ on any step with fewer real requests
        than `R`, or than tokens. Only a uniform key with `T == R` (every step as many tokens as
        requests) or `R == 1` leaves no doubt. Capture refuses such a key unless verification,
        whose probe batch has fewer requests than tokens and than `R`, proves the cut.
        """
        T, R = key.num_tokens, key.num_reqs
        if R is None or R <= 1 or (T == R and key.uniform):
            return None
        leaves, _ = flatten_output(output, str(key))
        names = _names(output)
        found = [
            (name, t)
            for t, kind, name in zip(leaves, self.kinds(output), names)
            if kind is None and t.shape[:1] == (R,)
        ]
        if not found:
            return None
        could, kinds = (
            ("per token or per request", "'tokens' | 'reqs'") if T == R else ("per request or whole", "'reqs' | 'none'")
        )
        one = len(found) == 1
        shapes = ", ".join(f"{_label(name)} {tuple(t.shape)}" for name, t in found)
        choices = (
            f"output_rows = {kinds}"
            if names == (None,)
            else "output_rows = {" + ", ".join(f"{name!r}: {kinds}" for name, _ in found) + "}"
        )
        return (
            f"{shapes} of {key}: {R} rows, the key's padded request count{' and token count' if T == R else ''}, so "
            f"{'it' if one else 'each'} could be {could}, and with checks.verify_replay off no verification proves "
            f"which. Declare {'it' if one else 'them'}, {choices}, or turn checks.verify_replay on"
        )

    def mismatch(self, output: Any, expected: Any, inputs: ForwardInputs) -> str | None:
        """Why the real rows of a replay's `output` and of an eager run (`expected`) have different shapes, or None."""
        T, R, n, r = _rows(inputs)
        leaves, _ = flatten_output(output, "the replay")
        others, _ = flatten_output(expected, "the eager run")
        replayed, _ = flatten_output(self.real(output, inputs), "the replay")
        for raw, t, e, kind, name in zip(leaves, replayed, others, self.kinds(output), _names(output)):
            if t.shape == e.shape:
                continue
            rows = e.shape[0] if e.dim() else None
            truth = {n: "tokens", r: "reqs"}.get(rows) if n != r and rows is not None else None
            truth = truth or ("none" if e.shape == raw.shape else None)
            cut = "cut to the real tokens, as its rows are the padded token count" if raw.shape[:1] == (T,) else "whole"
            how = f"declared {kind!r}" if kind else f"undeclared: {cut}"
            said = {"tokens": "a row per token", "reqs": "a row per request", "none": "whole"}.get(truth or "")
            fix = (
                f"it is {said}: declare it, {_declaration(name, truth)}"
                if truth
                else "a graph's output shapes are fixed at capture: return a row per token or per request, "
                "or a fixed shape"
            )
            return (
                f"{_label(name)} has shape {tuple(t.shape)} from the replay (shape {tuple(raw.shape)}, {how}) but "
                f"{tuple(e.shape)} from an eager run of the same {n} tokens and {r} requests (the key pads to {T} "
                f"tokens and {R} requests); {fix}"
            )
        return None

    def _resolve(self, names: tuple, output: Any) -> tuple[str | None, ...]:
        declared = self.declared
        if declared is None or isinstance(declared, str):
            return (declared,) * len(names)
        unknown = [k for k in declared if k not in names]
        if unknown:
            has = "one tensor" if names == (None,) else f"{_describe(output)}: outputs {', '.join(map(repr, names))}"
            raise CaptureError(
                f"model.output_rows declares {', '.join(map(repr, unknown))}, which the forward's result does not "
                f"have: it returned {has}. {_USAGE}"
            )
        return tuple(declared.get(p) for p in names)


def _cut(t: torch.Tensor, kind: str | None, name: Any, rows: tuple[int, int, int, int]) -> torch.Tensor:
    """Tensor `t` (output `name`, declared `kind` or None) cut to its real rows."""
    T, R, n, r = rows
    size = t.shape[0] if t.dim() else None
    if kind is None:
        return t[:n] if size == T else t
    if kind == "none":
        return t
    want, real = (T, n) if kind == "tokens" else (R, r)
    if size != want:
        other = {T: "tokens", R: "reqs"}.get(size) if T != R and size is not None else None
        fix = f"declare {_declaration(name, other)}" if other else "fix the declaration"
        raise CaptureError(
            f"{_label(name)} is declared {kind!r} (model.output_rows) but has shape {tuple(t.shape)}; a {kind!r} "
            f"output has a row per {kind[:-1]}, padded ones included: {want} rows here ({T} tokens, {R} requests). "
            f"{fix[0].upper() + fix[1:]}, or return the rows it declares"
        )
    return t[:real]


def _rows(inputs: ForwardInputs) -> tuple[int, int, int, int]:
    """`(T, R, num_tokens, num_reqs)`: the padded and real rows of a staged step."""
    return inputs.input_ids.shape[0], inputs.seq_lens.shape[0], inputs.num_tokens, inputs.num_reqs


def _names(output: Any) -> tuple:
    """What names each tensor of a result in `model.output_rows`: its key (a dict), its position (a tuple
    or list), or None (one tensor)."""
    if isinstance(output, dict):
        return tuple(output)
    if isinstance(output, (tuple, list)):
        return tuple(range(len(output)))
    return (None,)


def _label(name: Any) -> str:
    return "the output" if name is None else f"output {name!r}" if isinstance(name, str) else f"output [{name}]"


def _declaration(name: Any, kind: str) -> str:
    """What to write to declare one tensor, e.g. `output_rows = {'logits': 'reqs'}`."""
    return f"output_rows = {kind!r}" if name is None else f"output_rows = {{{name!r}: {kind!r}}}"


_USAGE = (
    "model.output_rows is 'tokens', 'reqs' or 'none' (every tensor of the result), or a dict of those by output "
    "name (a dict result) or position (a tuple or list result), e.g. {'hidden': 'tokens', 'logits': 'reqs'}"
)


def _checked(declared: Any) -> str | dict[str | int, str] | None:
    """`model.output_rows` as given, or a `ValueError` naming the value and what it may be."""
    if declared is None:
        return None
    if isinstance(declared, str):
        if declared not in ROW_KINDS:
            raise ValueError(f"model.output_rows is {declared!r}; {_USAGE}")
        return declared
    if not isinstance(declared, Mapping):
        raise ValueError(f"model.output_rows is a {type(declared).__name__}; {_USAGE}")
    for name, kind in declared.items():
        if isinstance(name, bool) or not isinstance(name, (str, int)) or kind not in ROW_KINDS:
            raise ValueError(f"model.output_rows[{name!r}] is {kind!r}; {_USAGE}")
    return dict(declared)
