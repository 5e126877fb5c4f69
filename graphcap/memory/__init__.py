"""Memory: what capture will cost, what each size's graph costs, and the budget graphs are held to.

| module | holds |
|---|---|
| `estimate.py` | `estimate_memory`: weights, KV cache, buffers, graphs and the capture transient; `available_memory` |
| `graph_costs.py` | `graph_costs`: each size's graph memory, priced for the sizes chooser |
| `budget.py` | `MemoryBudget`: `capture.memory_budget` split into keys that fit and keys over it |
| `measured.py` | `measure_graph`: a key's graph memory measured on a model graphcap has no arithmetic for |
"""

from graphcap.memory.budget import MemoryBudget
from graphcap.memory.estimate import estimate_memory

__all__ = ["MemoryBudget", "estimate_memory"]
