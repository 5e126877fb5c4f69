"""The validation machinery behind `graphcap.config`: typed sections and their problems.

A section is a frozen dataclass whose `__post_init__` checks every field against its type
hint (YAML 1.2 scalars: no bool where an int belongs, no quoted numbers) and its range
metadata, then the section's own cross-field `_check()`. All problems are raised at once.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import Field, field, fields
from typing import Any, ClassVar, Literal

from graphcap.config._yaml import YAML11_BOOLS
from graphcap.errors import ConfigError, ConfigProblem
from graphcap.fields import INT32_MAX, INT32_MIN

__all__ = ["Section", "problem", "show_value", "spec"]


def problem(key: str, message: str, *, involves: tuple[str, ...] = ()) -> ConfigProblem:
    """One problem of a section's `_check`: `key` is the field (dotted keys are kept as given),
    `involves` the other sections a cross-section rule compares with."""
    return ConfigProblem(key, message, involves=involves)


def spec(
    default: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    check: Callable[[Any], str] | None = None,
):
    """A field with its range, and `check(value) -> message` ("" when fine) for a rule of its own; both run
    with the type checks, so a field's problem is named beside every other field's."""
    return field(default=default, metadata={"min": min, "max": max, "gt": gt, "check": check})


class Section:
    """Validation shared by every section: field types and ranges, then `_check()`."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # every section is a dataclass
    _key: ClassVar[str]
    _hints_cache: ClassVar[dict[type, dict[str, Any]]] = {}

    def __post_init__(self) -> None:
        problems: list[ConfigProblem] = []
        hints = _hints(type(self))
        for f in fields(self):
            if not f.init:  # derived on construction (e.g. the resolved capture schedule)
                continue
            key = f"{self._key}.{f.name}" if self._key else f.name
            value = getattr(self, f.name)
            ok, converted, message = _convert(value, hints[f.name], key)
            if not ok:
                problems.append(ConfigProblem(key, message))
                continue
            if converted is not value:
                object.__setattr__(self, f.name, converted)
            message = _range_problem(converted, f.metadata)
            if not message and f.metadata and f.metadata.get("check") is not None:
                message = f.metadata["check"](converted)
            if message:
                problems.append(ConfigProblem(key, message))
        if not problems:
            problems = [p._replace(key=self._dotted(p.key)) for p in self._check()]
        if problems:
            raise ConfigError(problems)

    def _dotted(self, name: str) -> str:
        return f"{self._key}.{name}" if self._key and "." not in name else name

    def _check(self) -> list[ConfigProblem]:
        """Checks across this section's fields (built with `problem`); runs after the type checks."""
        return []


def _hints(cls: type) -> dict[str, Any]:
    cache = Section._hints_cache
    if cls not in cache:
        cache[cls] = typing.get_type_hints(cls)
    return cache[cls]


def _convert(value: Any, hint: Any, key: str) -> tuple[bool, Any, str]:
    """Check `value` against a field's type hint: `(ok, converted value, problem message)`."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
    for option in options:
        ok, converted = _matches(value, option)
        if ok:
            return True, converted, ""
    return False, value, f"expected {_describe(options)}; got {show_value(value)}{_trap_hint(value, options)}"


def _matches(value: Any, option: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(option)
    if option is type(None):
        return value is None, value
    if origin is Literal:
        return (isinstance(value, str) and value in typing.get_args(option)), value
    if option is bool:
        return isinstance(value, bool), value
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if option is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        return ok, float(value) if ok else value
    if option is str:
        return isinstance(value, str), value
    if origin is tuple:  # tuple[int, ...] or tuple[SomeSection, ...]
        item = typing.get_args(option)[0]
        if item is int:
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        elif item is float:
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
            )
            return (True, tuple(float(v) for v in value)) if ok else (False, value)
        else:  # a section, or a mapping (`Mapping[str, int]`: its section's checks look inside)
            kind = typing.get_origin(item) or item
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, kind) for v in value)
        return (True, tuple(value)) if ok else (False, value)
    if origin is Mapping:  # `Mapping[str, ...]`: the section's own checks look inside
        return isinstance(value, Mapping), value
    if isinstance(option, type):
        return isinstance(value, option), value
    return False, value


def _describe(options: tuple) -> str:
    words = []
    for option in options:
        if option is type(None):
            words.append("null")
        elif typing.get_origin(option) is Literal:
            words.append(" | ".join(map(str, typing.get_args(option))))
        elif typing.get_origin(option) is tuple:
            item = typing.get_args(option)[0]
            words.append({int: "a list of integers", float: "a list of numbers"}.get(item, "a list of mappings"))
        elif option is bool:
            words.append("true or false")
        else:
            words.append(
                {int: "an integer", float: "a number", str: "a string", Mapping: "a mapping"}.get(
                    typing.get_origin(option) or option, getattr(option, "__name__", str(option))
                )
            )
    return " or ".join(words)


def _trap_hint(value: Any, options: tuple) -> str:
    if isinstance(value, str) and value in YAML11_BOOLS and bool in options:
        return f" (YAML 1.1 reads {value!r} as a boolean; graphcap reads YAML 1.2: write true or false)"
    if isinstance(value, bool) and any(typing.get_origin(o) is Literal for o in options):
        return " (write the word in quotes if you meant a choice)"
    if isinstance(value, str) and (int in options or float in options):
        try:
            float(value)
        except ValueError:
            return ""
        return " (a quoted number is a string: drop the quotes)"
    return ""


def _range_problem(value: Any, meta: Any) -> str:
    if value is None or isinstance(value, (str, tuple)) or not meta:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite; got {value}"
    # Name why an int32 bound exists: the number alone looks arbitrary.
    if meta.get("min") is not None and value < meta["min"]:
        note = " (the int32 range of the staging buffers)" if meta["min"] == INT32_MIN else ""
        return f"must be >= {meta['min']}{note}; got {value}"
    if meta.get("max") is not None and value > meta["max"]:
        note = " (the int32 range of the staging buffers)" if meta["max"] == INT32_MAX else ""
        return f"must be <= {meta['max']}{note}; got {value}"
    if meta.get("gt") is not None and not value > meta["gt"]:
        return f"must be > {meta['gt']}; got {value}"
    return ""


def show_value(value: Any) -> str:
    kind = "null" if value is None else type(value).__name__
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})" if value is not None else "null"


_UnionType = type(int | None)
