"""Capture: the pass that records graphs, what checks each one, and the graphs over an engine's life.

| module | holds |
|---|---|
| `calls.py` | `CaptureCalls`: the manager's `capture()`, `capture_pending()`, `pending()` |
| `driver.py` | `run_pass`: one pass end to end (budget, GC, block tables set aside, reservation, install) |
| `runner.py` | `CapturePass`: preflight, warmups, record and verify per key |
| `gc_hold.py` | GC held still: `gc_frozen` around an upfront pass, `gc_paused` around a lazy key |
| `probing.py` | the verification runs of a key: its dummy batch, a probe batch at each fill level |
| `verification.py` | the capture-time replay comparison (`compare_replay`) and its messages |
| `carried.py` | naming state a forward carries between runs, when a replay and an eager run differ |
| `axes.py` | verification of each key at a lower key-axis value (padded axis slots must be neutral) |
| `failures.py` | `FailurePolicy`: what a failed key does (`capture.on_error`) |
| `timing.py` | `time_key`, `replay_speedup`: eager vs replay per key (`capture.min_speedup`) |
| `lifecycle.py` | `LiveGraphs`: the installed graphs, release, resize, what a re-capture keeps |
| `lazy.py` | `LazyCapture`: which pending key to capture next in idle time, and when to stop |
"""

from graphcap.capture.lazy import LazyCapture
from graphcap.capture.lifecycle import LiveGraphs
from graphcap.capture.runner import CapturePass

__all__ = ["CapturePass", "LazyCapture", "LiveGraphs"]
