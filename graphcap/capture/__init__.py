"""Capture: the pass that records graphs, what checks each one, and the graphs over an engine's life.

| module | holds |
|---|---|
| `capturer.py` | `Capturer`: the manager's `capture()`, `capture_pending()`, `pending()`, and the pass loop |
| `parts.py` | `CaptureParts`: what a pass needs from its manager, typed, built once |
| `recorder.py` | `Recorder.record(key) -> Recorded`: the dummy batch, warmups, the backend's capture |
| `verifier.py` | `Verifier.verify(recorded) -> Verified`: the dummy batch, each fill level, each lower axis value |
| `references.py` | `SharedReferences`: a pass's kept eager results of probe batches, injected into the verifier |
| `outcome.py` | `KeyOutcome`: one key's outcome (its eager reason a field); the report's `GraphRecord` from it |
| `verification.py` | the replay comparison (`compare_replay`, raising `ReplayMismatchError`) and its messages |
| `carried.py` | naming state a forward carries between runs, when a replay and an eager run differ |
| `gc_hold.py` | GC held still: `gc_frozen` around an upfront pass, `gc_paused` around a lazy key |
| `failures.py` | `FailurePolicy`: what a failed key does (`capture.on_error`), and where it failed |
| `timing.py` | `time_key`, `replay_speedup`: eager vs replay per key (`capture.min_speedup`) |
| `lifecycle.py` | `LiveGraphs`: the installed graphs, release, resize, what a re-capture keeps |
| `lazy.py` | `LazyCapture`: which pending key to capture next in idle time, and when to stop |
"""

from graphcap.capture.capturer import Capturer
from graphcap.capture.lazy import LazyCapture
from graphcap.capture.lifecycle import LiveGraphs
from graphcap.capture.outcome import KeyOutcome
from graphcap.capture.parts import CaptureParts

__all__ = ["CaptureParts", "Capturer", "KeyOutcome", "LazyCapture", "LiveGraphs"]
