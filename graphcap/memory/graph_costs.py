"""`graph_costs`: graphcap's memory estimate of the graphs, split per capture size for the size chooser.

`graphcap.sizing.choice.choose_sizes` keeps a schedule within a memory budget by the bytes
`GraphCosts` gives each size; this module reads them off `estimate_memory`, so the chooser and
`graphcap sizes`/`capture` never disagree (`tests/test_size_choice.py` checks that the parts add
up to the estimate of every schedule). Imports no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from graphcap.keys import KeyRegistry
from graphcap.memory.estimate import estimate_memory
from graphcap.sizing.choice import GraphCosts

if TYPE_CHECKING:
    from graphcap.config import CaptureConfig

__all__ = ["graph_costs"]


def graph_costs(config: CaptureConfig, sizes: Iterable[int], backend: str) -> GraphCosts:
    """`GraphCosts` of capturing any subset of `sizes` with `config`, by `estimate_memory`.

    It mirrors how the estimate adds graphs up: on `cuda` every graph shares one pool that holds
    the largest key's activations and output (`shared`, an upper bound where a smaller key
    happens to need more); on `emulated` each key keeps its static output (`per_size`), and the
    uniform key of `batching.max_num_seqs` requests, which every schedule reaching it gets, is
    `shared`. With key axes (`capture.axes`) a size costs its keys at every combination of axis values
    (one schedule serves every combination). Raises `ValueError` for a factory model (no per-graph estimate).
    """
    sizes = tuple(sorted(set(sizes)))
    if config.model.factory is not None:
        raise ValueError(
            f"model.factory {config.model.factory} has no per-graph memory estimate (its estimate_memory "
            "gives one number); a memory budget works with the built-in models"
        )
    capture = dataclasses.replace(config.capture, sizes=sizes, max_size=sizes[-1])
    config = dataclasses.replace(config, capture=capture)
    keys = KeyRegistry.from_config(config).planned
    graphs = estimate_memory(config, backend=backend).graphs
    if [k.num_tokens for k in keys] != [g.num_tokens for g in graphs]:
        raise RuntimeError("estimate_memory no longer lists one graph per planned key, in order")
    q, rows = config.capture.uniform_query_len, config.batching.max_num_seqs
    top = (rows * q, rows)  # the uniform key every schedule reaching it plans (sizes.uniform_sizes)
    per_size = dict.fromkeys(sizes, 0)
    extra_from, extra, peaks = None, 0, dict.fromkeys(sizes, 0)
    for key, graph in zip(keys, graphs, strict=True):
        own = graph.output if backend == "emulated" else 0
        if key.uniform and (key.num_tokens, key.num_reqs) == top:  # once per combination of axis values
            extra_from, extra = key.num_tokens, extra + own
        else:
            per_size[key.num_tokens] += own
        if backend == "cuda":  # a key counts from the smallest size whose schedules plan it
            at = sizes[bisect.bisect_left(sizes, key.num_tokens)]
            peaks[at] = max(peaks[at], graph.activations + graph.output)
    shared, peak = {}, 0
    for s in sizes:
        peak = max(peak, peaks[s])
        shared[s] = peak + (extra if extra_from is not None and s >= extra_from else 0)
    return GraphCosts(per_size, shared, backend)
