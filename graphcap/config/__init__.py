"""`CaptureConfig`: a frozen dataclass tree, validated on construction, loaded from strict YAML.

| module | holds |
|---|---|
| `root.py` | the root `CaptureConfig` and the rules that span sections |
| `model.py` | the `model:` section |
| `sections.py` | the other section dataclasses (with their checks) |
| `buffers.py` | the `buffers:` list (engine buffers) and the rules every buffer declaration keeps |
| `_load.py` | `load_config`, `config_from_text`: reading, overrides, unknown keys, `file:line` |
| `_schema.py` | the validation machinery every section shares (types, ranges, problems) |
| `_yaml.py` | strict YAML 1.2 reading with a line for every key; `parse_scalar` (one `--set` value) |
| `fingerprint.py` | the config's fingerprint (what data-parallel ranks must share), key by key |

Importing this package does not import torch (the CLI's `validate` and `sizes` stay fast).
"""

from __future__ import annotations

from graphcap.config._load import DEFAULT_CONFIG, MAX_CONFIG_BYTES, bundled_configs, config_from_text, load_config
from graphcap.config._yaml import YamlSyntaxError, parse_scalar
from graphcap.config.checks import ChecksConfig, ReportConfig
from graphcap.config.model import BUILTIN_MODELS, ModelConfig
from graphcap.config.root import SECTIONS, CaptureConfig
from graphcap.config.sections import (
    PAD_SLOT_ID,
    BatchingConfig,
    CaptureSectionConfig,
    KVCacheConfig,
    PadRules,
)
from graphcap.errors import ConfigError, ConfigProblem  # DESIGN places ConfigError with the config

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_CONFIG",
    "MAX_CONFIG_BYTES",
    "PAD_SLOT_ID",
    "SECTIONS",
    "BatchingConfig",
    "CaptureConfig",
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
]
