"""Sizing: which padded sizes are captured, and how they are chosen from traffic.

| module | holds |
|---|---|
| `sizes.py` | `CaptureSizes` (validated schedule, O(1) padding table), `default_capture_sizes`, `uniform_sizes` |
| `choice.py` | sizes chosen from a traffic histogram: `choose_sizes`, `candidate_sizes`, `SizeConstraints` |
"""

from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes

__all__ = ["CaptureSizes", "default_capture_sizes"]
