"""Staging: the persistent buffers every graph reads, and the one path that fills them for a step.

| module | holds |
|---|---|
| `buffers.py` | `PersistentBuffers`: owns the parts below; `stage()`, `upload()` |
| `layout.py` | `PackedLayout`: the packed host/device buffer, per-key views, the upload and its event |
| `plans.py` | `PlanCache`: per-step plans, their scratch and constants |
| `passes.py` | the decode and general passes: check everything, then write |
| `padding.py` | `PadWriter`: padded rows written from `FIELD_TABLE`, only where dirty |
| `refusals.py` | the rule-by-rule `BatchError` of a refused step |
| `extras.py` | engine buffers (`BufferSpec`) in staging |
| `groups.py` | `GroupStaging`: the block tables and slot mappings of extra KV-cache groups |
"""

from graphcap.staging.buffers import POISON, PersistentBuffers

__all__ = ["POISON", "PersistentBuffers"]
