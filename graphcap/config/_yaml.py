"""Strict YAML reading: YAML 1.2 scalars, duplicate keys refused, a line for every key.

PyYAML resolves scalars by YAML 1.1, which turns `off`, `no`, `y` into booleans and
leaves `1e-5` a string. graphcap reads the YAML 1.2 core schema instead: only
`true`/`false` are booleans, `1e-5` is a float, everything else that is not a number or
null is a string. A boolean field given `off` then fails with a message that says why.

`yaml.safe_load` semantics are kept (composition uses `SafeLoader`; no tags that build
Python objects); values are built here from the node tree so each key's line is known.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

__all__ = ["YamlDocument", "YamlSyntaxError", "parse_scalar", "read_yaml"]


class _TooManyNodes(yaml.MarkedYAMLError):
    """Composition stopped at `MAX_NODES`."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's implicit resolvers and a bound on the nodes.

    The bound applies while composing: a 1 MiB flow list is 500,000 nodes and took PyYAML's
    pure-Python composer seconds to build before any check could look at it.
    """

    # types-PyYAML declares it per instance; PyYAML reads (and copies) it from the class.
    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {}  # type: ignore[misc]

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.num_nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.num_nodes += 1
        if self.num_nodes > MAX_NODES:
            raise _TooManyNodes(problem=f"more than {MAX_NODES} values", problem_mark=self.peek_event().start_mark)
        return super().compose_node(parent, index)


_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
for _tag, _regex, _first in (
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
    ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
    ("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789")),
):
    _Loader.add_implicit_resolver(_tag, _regex, _first)

_STR, _SEQ, _MAP = (f"tag:yaml.org,2002:{t}" for t in ("str", "seq", "map"))
# YAML 1.1 words that people mean as booleans; named in error messages.
YAML11_BOOLS = frozenset(
    ["y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF"]
)
# Values one document may build. Aliases expand (`b: [*a, *a, ...]` nested a few levels is
# a "billion laughs" bomb); a config holds a few dozen values, a long size list thousands.
MAX_VALUES = 1 << 17
MAX_NODES = 1 << 14
"""Nodes one document may hold before aliases expand (checked while composing)."""
MAX_INT_DIGITS = 100
"""Longest integer literal read. Config integers have at most 20 digits; a longer one is refused as
"integer too long" before Python's own 4300-digit conversion limit turns it into a traceback."""


class YamlSyntaxError(ValueError):
    """The text is not YAML graphcap accepts. `.key` (dotted, or "") and `.where` (`file:line`)."""

    def __init__(self, where: str, key: str, message: str) -> None:
        self.where, self.key, self.message = where, key, message
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")


@dataclass
class YamlDocument:
    """A parsed document: plain Python values plus the 1-based line of every dotted key."""

    data: Any
    lines: dict[str, int] = field(default_factory=dict)
    source: str = "<string>"
    num_values: int = 0
    """Values built so far (bounded by `MAX_VALUES`)."""


def parse_scalar(text: str) -> Any:
    """Parse one YAML 1.2 scalar the way a config file would (`--set` values use this).

    A quoted value is a string without its quotes (`"8"` is the string 8, as in a file); a
    flow list or mapping (`[1, 2]`) is parsed as YAML. Raises `YamlSyntaxError` (where
    `<value>`) for text YAML refuses and for an integer of more than `MAX_INT_DIGITS` digits.
    """
    if _NULL.match(text):
        return None
    if _BOOL.match(text):
        return text.lower() == "true"
    if _INT.match(text):
        digits = len(text.lstrip("+-")) - (2 if text.startswith(("0x", "0o")) else 0)
        if digits > MAX_INT_DIGITS:
            raise YamlSyntaxError("<value>", "", f"integer too long ({digits} digits; a config integer has at most 20)")
        if text.startswith(("0x", "0o")):
            return int(text[2:], 16 if text[1] == "x" else 8)
        return int(text, 10)
    if _FLOAT.match(text):
        lowered = text.lower()
        if lowered.endswith(".inf"):
            return -math.inf if lowered.startswith("-") else math.inf
        if lowered == ".nan":
            return math.nan
        return float(text)
    if text.startswith(("[", "{", '"', "'")):
        return read_yaml(text, source="<value>").data
    return text


def read_yaml(text: str, source: str = "<string>") -> YamlDocument:
    """Parse `text`; raise `YamlSyntaxError` (with `file:line`) on bad YAML or duplicate keys."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except _TooManyNodes as exc:
        message = f"{exc.problem}; a config holds a few dozen (is it the right file?)"
        line = "?" if exc.problem_mark is None else exc.problem_mark.line + 1
        raise YamlSyntaxError(f"{source}:{line}", "", message) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise YamlSyntaxError(where, "", f"not valid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(source, "", f"not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlSyntaxError(source, "", _TOO_DEEP) from None
    doc = YamlDocument(data=None, source=source)
    if node is not None:
        try:
            doc.data = _build(node, "", doc)
        except RecursionError:  # deep nesting, or an alias inside its own anchor
            raise YamlSyntaxError(source, "", _TOO_DEEP) from None
    return doc


_TOO_DEEP = "nested too deeply (or an alias refers to its own anchor); a config is a few levels deep"


def _build(node: yaml.Node, key: str, doc: YamlDocument) -> Any:
    line = node.start_mark.line + 1  # PyYAML marks count from 0
    doc.num_values += 1
    if doc.num_values > MAX_VALUES:
        raise YamlSyntaxError(
            f"{doc.source}:{line}",
            key,
            f"the document builds more than {MAX_VALUES} values (aliases expanding?); a config holds a few dozen",
        )
    if key:
        doc.lines.setdefault(key, line)
    if isinstance(node, yaml.MappingNode):
        if node.tag != _MAP:
            raise YamlSyntaxError(f"{doc.source}:{line}", key, f"tag {node.tag} is not allowed")
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YamlSyntaxError(f"{doc.source}:{line}", key, "merge keys (<<) are not supported")
            name = _build(key_node, "", doc)
            if not isinstance(name, str):
                raise YamlSyntaxError(
                    f"{doc.source}:{key_node.start_mark.line + 1}", key, f"keys must be strings; got {name!r}"
                )
            child = f"{key}.{name}" if key else name
            if name in out:
                raise YamlSyntaxError(
                    f"{doc.source}:{key_node.start_mark.line + 1}",
                    child,
                    f"duplicate key (first at line {doc.lines[child]}); keep one",
                )
            doc.lines[child] = key_node.start_mark.line + 1
            out[name] = _build(value_node, child, doc)
        return out
    if isinstance(node, yaml.SequenceNode):
        if node.tag != _SEQ:
            raise YamlSyntaxError(f"{doc.source}:{line}", key, f"tag {node.tag} is not allowed")
        return [_build(item, f"{key}[{i}]", doc) for i, item in enumerate(node.value)]
    if node.tag == _STR:
        return node.value
    if node.tag.startswith("tag:yaml.org,2002:") and node.tag[18:] in ("null", "bool", "int", "float"):
        # Explicit `!!int 3` resolves here too; a value that does not match its tag is an error.
        try:
            value = parse_scalar(node.value)
        except YamlSyntaxError as exc:  # an integer too long: located here
            raise YamlSyntaxError(f"{doc.source}:{line}", key, exc.message) from None
        if node.tag.endswith("float"):
            if isinstance(value, (float, int)):
                return float(value)
        elif isinstance(value, {"null": type(None), "bool": bool, "int": int}[node.tag[18:]]):
            return value
    raise YamlSyntaxError(f"{doc.source}:{line}", key, f"tag {node.tag} is not allowed")
