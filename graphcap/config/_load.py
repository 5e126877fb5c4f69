"""Loading a `CaptureConfig` from YAML text, a file or the embedded default, with overrides.

The sections validate themselves (`sections.py`); this module reads the document strictly
(`_yaml.py`), applies dotted overrides, finds unknown keys, builds every section, and turns
all problems into one `ConfigError`, each located at `file:line` (or `override`).
"""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Mapping
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from graphcap.config._schema import Section, show_value
from graphcap.config._yaml import YamlSyntaxError, read_yaml
from graphcap.config.buffers import BufferConfig
from graphcap.config.root import SECTIONS, CaptureConfig
from graphcap.config.sections import KVGroupConfig
from graphcap.errors import ConfigError, ConfigFileNotFoundError, ConfigProblem

_S = TypeVar("_S", bound=Section)

__all__ = ["DEFAULT_CONFIG", "MAX_CONFIG_BYTES", "bundled_configs", "config_from_text", "load_config", "report_outside"]

DEFAULT_CONFIG = "default.yaml"
"""The embedded default, shipped inside the package (`graphcap/configs/`)."""

MAX_CONFIG_BYTES = 1 << 20
"""Largest config read (1 MiB). A config is a few KiB; anything near this is the wrong file
(a log, a checkpoint, `/dev/zero`), and is refused before any of it is parsed."""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> CaptureConfig:
    """Load a `CaptureConfig` from YAML; `path=None` is the embedded default.

    `path` is a file, or the name of a config shipped with graphcap (`"tiny-cpu-ci"`, see
    `bundled_configs`) when no file of that name exists. `overrides` maps dotted keys to values
    (`{"capture.max_size": 16}`) applied on top of the file and validated the same way; an
    override of `model.factory` without one of `model.name` replaces the file's model name
    (and the other way round). A `report.path` the file itself gives must lie under the file's
    directory or the working directory (an override may point anywhere). Raises `ConfigError`
    listing every problem (dotted key, bad value, what is allowed, `file:line`), also for a
    file that cannot be read (key `<file>`, with the OS reason), is not UTF-8 or is larger than
    `MAX_CONFIG_BYTES`; for a missing file the error is also a `FileNotFoundError`; `TypeError`
    when `overrides` is not a mapping.
    """
    if path is None:
        text = _bundled(DEFAULT_CONFIG).read_text()
        return _from_text(text, f"<embedded {DEFAULT_CONFIG}>", overrides, _bundled_directory(), None)
    source = str(path)
    bundled = None if os.path.lexists(source) else _bundled_name(source)
    if bundled is not None:
        resource = _bundled(bundled)
        return _from_text(resource.read_text(), _shown_path(resource), overrides, _bundled_directory(), None)
    text = _read_file(source)
    return _from_text(text, source, overrides, Path(source).parent, source)


def bundled_configs() -> tuple[str, ...]:
    """Names of the configs shipped inside the package (`load_config(name)`, `--config NAME`)."""
    return tuple(sorted(p.name[: -len(".yaml")] for p in _bundled_directory().iterdir() if p.name.endswith(".yaml")))


def _bundled_directory() -> Any:
    return resources.files("graphcap").joinpath("configs")


def _bundled(file_name: str) -> Any:
    return _bundled_directory().joinpath(file_name)


def _bundled_name(text: str) -> str | None:
    """`text` as the file name of a bundled config (`tiny-cpu-ci` or `tiny-cpu-ci.yaml`), or None."""
    if "/" in text or os.sep in text:
        return None
    name = text if text.endswith(".yaml") else f"{text}.yaml"
    return name if name[: -len(".yaml")] in bundled_configs() else None


def _shown_path(resource: Any) -> str:
    return str(resource) if isinstance(resource, Path) else f"<bundled {resource.name}>"


def _read_file(path: str) -> str:
    """The text of a config file: at most `MAX_CONFIG_BYTES` are read, whatever the file is."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        names = ", ".join(bundled_configs())
        message = f"config file not found: {path} (configs shipped with graphcap, loadable by name: {names})"
        error = ConfigFileNotFoundError([ConfigProblem("<file>", message)], path)
        error.errno, error.filename = errno.ENOENT, path
        raise error from None
    except OSError as exc:  # EACCES, EISDIR, ELOOP, ENOTDIR, ENAMETOOLONG, EIO, ...
        raise _file_error(path, f"cannot read {path}: {_os_reason(exc)}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _file_error(
            path,
            f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a config is a few KiB (is it the right file?)",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        message = f"{path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}"
        raise ConfigError([ConfigProblem("<file>", message, f"{path}:{line}")], path) from None


def _os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    return f"{exc.strerror or exc} ({name})" if name else str(exc.strerror or exc)


def _file_error(path: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem("<file>", message)], path)


def config_from_text(text: str, source: str = "<string>", overrides: dict[str, Any] | None = None) -> CaptureConfig:
    """`load_config` on YAML text already in memory (a `report.path` in it must lie under the
    working directory: the text has no directory of its own)."""
    return _from_text(text, source, overrides, None, None)


def _from_text(
    text: str, source: str, overrides: dict[str, Any] | None, directory: Any, file: str | None
) -> CaptureConfig:
    """The config of `text`; `directory` is where it came from (a report may go there), `file`
    the path it was read from (`CaptureConfig.source`)."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must map dotted keys to values; got {type(overrides).__name__}")
    if len(text) > MAX_CONFIG_BYTES:
        message = f"the text has {len(text)} characters, above {MAX_CONFIG_BYTES}; a config is a few KiB"
        raise ConfigError([ConfigProblem("<file>", message)], source)
    try:
        doc = read_yaml(text, source)
    except YamlSyntaxError as exc:
        raise ConfigError([ConfigProblem(exc.key or "<yaml>", exc.message, exc.where)], source) from None
    data = {} if doc.data is None else doc.data
    if not isinstance(data, dict):
        message = f"the root must be a mapping of sections; got {type(data).__name__}"
        raise ConfigError([ConfigProblem("<root>", message, f"{source}:1")], source)
    problems: list[ConfigProblem] = []
    data, override_keys = _apply_overrides(data, overrides or {}, problems)

    def where(key: str) -> str | None:
        if key in override_keys or key.split("[")[0] in override_keys or key.rpartition(".")[0] in override_keys:
            return "override"  # the key itself, an entry of a list, or an entry of a mapping (capture.axes.lora)
        while key:
            if key in doc.lines:
                return f"{source}:{doc.lines[key]}"
            key = key.rpartition(".")[0] if "." in key else key.partition("[")[0] if "[" in key else ""
        return None

    kwargs: dict[str, Any] = {}
    valid_top = ["device", *SECTIONS, "buffers"]
    for name, value in data.items():
        if name == "device":
            kwargs["device"] = value
        elif name == "buffers":
            kwargs["buffers"] = _buffers(value, problems)
        elif name not in SECTIONS:
            problems.append(_unknown(name, "", valid_top))
        elif value is None:
            continue  # an empty section means its defaults
        elif not isinstance(value, dict):
            problems.append(ConfigProblem(name, f"must be a mapping of keys; got {show_value(value)}"))
        else:
            cls = SECTIONS[name]
            valid = [f.name for f in fields(cls) if f.init]
            problems += [_unknown(k, name, valid) for k in value if k not in valid]
            given = {k: v for k, v in value.items() if k in valid}
            if name == "kv_cache" and "groups" in given:
                given["groups"] = _entries(given["groups"], KVGroupConfig, "kv_cache.groups", problems)
            try:
                kwargs[name] = cls(**given)
            except ConfigError as exc:
                problems += exc.problems
    failed = {_section_of(p.key) for p in problems}
    config = None
    try:
        config = CaptureConfig(**kwargs, source=file)
    except ConfigError as exc:
        # Sections that failed were left at their defaults: keep only the cross-section
        # problems that involve none of them, so each problem reported is real.
        problems += [p for p in exc.problems if failed.isdisjoint((_section_of(p.key), *p.involves))]
    if config is not None and config.report.path and "report.path" not in override_keys:
        outside = report_outside(config.report.path, directory)
        if outside:
            problems.append(ConfigProblem("report.path", outside))
    if config is not None and config.report.postmortem and "report.postmortem" not in override_keys:
        outside = report_outside(config.report.postmortem, directory, "--set report.postmortem=...")
        if outside:
            problems.append(ConfigProblem("report.postmortem", outside))
    if problems or config is None:  # None: CaptureConfig refused it (its problems are listed)
        located = [p._replace(where=p.where or where(p.key)) for p in problems]
        located.sort(key=lambda p: _line_of(p.where))
        raise ConfigError(located, source)
    return config


def _buffers(value: Any, problems: list[ConfigProblem]) -> tuple[BufferConfig, ...]:
    """The `buffers:` list, each entry validated like a section (keys `buffers[i].field`)."""
    return _entries(value, BufferConfig, "buffers", problems)


def _entries(value: Any, cls: type[_S], key: str, problems: list[ConfigProblem]) -> tuple[_S, ...]:
    """A list of mappings (`buffers`, `kv_cache.groups`), each built as `cls` (keys `KEY[i].field`)."""
    if value is None:
        return ()
    noun, names = ("buffer", "ForwardInputs.extras") if cls is BufferConfig else ("group", "ForwardInputs.kv_groups")
    if not isinstance(value, (list, tuple)):
        problems.append(ConfigProblem(key, f"must be a list of {noun} mappings; got {show_value(value)}"))
        return ()
    valid = [f.name for f in fields(cls) if f.init]
    out = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(entry, cls):  # given in code (overrides)
            out.append(entry)
            continue
        if not isinstance(entry, dict):
            problems.append(ConfigProblem(where, f"must be a mapping ({', '.join(valid)}); got {show_value(entry)}"))
            continue
        problems += [_unknown(k, where, valid) for k in entry if k not in valid]
        if "name" not in entry:
            problems.append(ConfigProblem(f"{where}.name", f"is required: it names {names}[name]"))
            continue
        try:
            out.append(cls(**{k: v for k, v in entry.items() if k in valid}))
        except ConfigError as exc:
            problems += [p._replace(key=p.key.replace(f"{key}[]", where)) for p in exc.problems]
    return tuple(out)


def report_outside(path: str, directory: Any, given: str = "--report, --set report.path=...") -> str | None:
    """Why a `report.path` that a config gives may not be written (None: it may).

    A config is data, yet its report path makes graphcap write a file: that path must resolve
    (links followed) under the config's `directory` or the working directory. A path given by
    the caller (an override, `--report`) is not held to this.
    """
    try:
        target = Path(path).resolve()
        homes = [Path.cwd().resolve()] + ([Path(str(directory)).resolve()] if directory is not None else [])
    except (OSError, RuntimeError) as exc:  # a loop of links, a name too long
        return f"{path} cannot be resolved ({exc}); give the report path on the command line instead"
    if any(target.is_relative_to(home) for home in homes):
        return None
    where = " or ".join(str(home) for home in reversed(homes))
    return (
        f"{path} resolves to {target}, outside {where}; a config may write its report only under its own "
        f"directory or the working directory: give this path on the command line ({given})"
    )


def _section_of(key: str) -> str:
    return key.partition(".")[0].partition("[")[0]


def _apply_overrides(
    data: dict[str, Any], overrides: Mapping[str, Any], problems: list[ConfigProblem]
) -> tuple[dict[str, Any], set[str]]:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    applied = set()
    # `--set model.factory=pkg.mod:fn` means "this model": it replaces the file's (or the
    # default's) model name, which would otherwise clash with it; and the other way round.
    for given, replaced in (("model.factory", "model.name"), ("model.name", "model.factory")):
        model = data.get("model")
        if overrides.get(given) is not None and replaced not in overrides and isinstance(model, dict):
            model.pop(replaced.partition(".")[2], None)
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if len(parts) == 1 and parts[0] in ("device", "buffers"):
            data[parts[0]] = value
        elif len(parts) == 2 and parts[0] in SECTIONS:
            section = data.get(parts[0])
            if section is None:
                section = data[parts[0]] = {}
            if not isinstance(section, dict):
                continue  # the section's own problem is reported
            section[parts[1]] = value
        else:
            valid = ["device", "buffers", *(f"{s}.KEY" for s in SECTIONS)]
            message = f"not a config key; overrides look like {', '.join(valid)}"
            problems.append(ConfigProblem(str(dotted), message, "override"))
            continue
        applied.add(str(dotted))
    return data, applied


def _unknown(name: str, section: str, valid: list[str]) -> ConfigProblem:
    key = f"{section}.{name}" if section else name
    hint = difflib.get_close_matches(str(name), valid, n=1)
    did_you_mean = f" (did you mean {hint[0]}?)" if hint else ""
    where = f" in {section}" if section else ""
    return ConfigProblem(key, f"unknown key{did_you_mean}; valid keys{where}: {', '.join(valid)}")


def _line_of(where: str | None) -> tuple[int, str]:
    if where and ":" in where:
        tail = where.rpartition(":")[2]
        if tail.isdigit():
            return int(tail), where
    return 1 << 30, where or ""
