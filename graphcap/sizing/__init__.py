"""Sizing: which padded sizes are captured, and how they are chosen from traffic.

| module | holds |
|---|---|
| `sizes.py` | `CaptureSizes` (validated schedule, O(1) padding table), `default_capture_sizes`, `uniform_sizes` |
| `choice.py` | sizes chosen from a traffic histogram: `choose_sizes`, `candidate_sizes`, `SizeConstraints` |
| `held_out.py` | their waste scored on steps they were not chosen from: `choose_held_out`, `split_steps` |
| `axes.py` | key axes: `choose_with_axes` (a graph per size and combination), `choose_axis_values` |
"""

from graphcap.sizing.sizes import CaptureSizes, default_capture_sizes

__all__ = ["CaptureSizes", "default_capture_sizes"]
