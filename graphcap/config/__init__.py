"""`CaptureConfig`: a frozen dataclass tree, validated on construction, loaded from strict YAML.

| module | holds |
|---|---|
| `sections.py` | the section dataclasses and the root `CaptureConfig` (with their checks) |
| `_load.py` | `load_config`, `config_from_text`: reading, overrides, unknown keys, `file:line` |
| `_schema.py` | the validation machinery every section shares (types, ranges, problems) |
| `_yaml.py` | strict YAML 1.2 reading with a line for every key; `parse_scalar` (one `--set` value) |
| `fingerprint.py` | the config's fingerprint (what data-parallel ranks must share), key by key |

Importing this package does not import torch (the CLI's `validate` and `sizes` stay fast).
"""

from __future__ import annotations

from typing import Any

from graphcap.config._load import DEFAULT_CONFIG, MAX_CONFIG_BYTES, bundled_configs, config_from_text, load_config
from graphcap.config._yaml import YamlSyntaxError, parse_scalar
from graphcap.config.sections import (
    BACKEND_NAMES,
    BUILTIN_MODELS,
    PAD_SLOT_ID,
    SECTIONS,
    BatchingConfig,
    CaptureConfig,
    CaptureOptions,
    CaptureSectionConfig,
    ChecksConfig,
    KVCacheConfig,
    ModelConfig,
    PadRules,
    ReportConfig,
)
from graphcap.errors import ConfigError, ConfigProblem

__all__ = [
    "BACKEND_NAMES",
    "BUILTIN_MODELS",
    "DEFAULT_CONFIG",
    "MAX_CONFIG_BYTES",
    "PAD_SLOT_ID",
    "SECTIONS",
    "BatchingConfig",
    "CaptureConfig",
    "CaptureOptions",
    "CaptureSectionConfig",
    "ChecksConfig",
    "ConfigError",
    "ConfigProblem",
    "KVCacheConfig",
    "ModelConfig",
    "PadRules",
    "ReportConfig",
    "YamlSyntaxError",
    "bundled_configs",
    "config_from_text",
    "load_config",
    "parse_scalar",
    "resolve_device",
]


def __getattr__(name: str) -> Any:
    # `resolve_device` lives with the backends (it needs torch); imported on first use so
    # that loading a config never imports torch.
    if name == "resolve_device":
        from graphcap.backends import resolve_device

        return resolve_device
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
