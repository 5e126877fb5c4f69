"""Keys: what a captured graph is keyed by, and the one registry that makes and dispatches them.

| module | holds |
|---|---|
| `key.py` | `GraphKey`, `Mode`, `Dispatch`, `EAGER_REASONS` (the one table of eager reasons), `reason_kind` |
| `axes.py` | `KeyAxes`: key axes beyond tokens (`capture.axes`), their padding tables and combinations |
| `registry.py` | `KeyRegistry`: keys planned from the config, marked captured or skipped, dispatched in O(1) |
| `stats.py` | `StepStats`: graph hits per key, eager steps per reason, padded-token waste |
"""

from graphcap.keys.key import EAGER_REASONS, NOT_CAPTURED_WARNING, Dispatch, GraphKey, Mode, reason_kind
from graphcap.keys.registry import MIXED_ROWS_FLOOR, MIXED_ROWS_STEP, KeyRegistry, mixed_request_rows
from graphcap.keys.stats import StepStats

__all__ = [
    "EAGER_REASONS",
    "MIXED_ROWS_FLOOR",
    "MIXED_ROWS_STEP",
    "NOT_CAPTURED_WARNING",
    "Dispatch",
    "GraphKey",
    "KeyRegistry",
    "Mode",
    "StepStats",
    "mixed_request_rows",
    "reason_kind",
]
