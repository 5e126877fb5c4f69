"""Capture verification: a new graph replays two batches and each must match an eager run.

The first is the capture's own dummy batch (the graph replays what it recorded). The second,
`probe_batch`, is partly filled and differs from the dummy in every value, so padded rows run
and a host value the graph froze at capture (a Python count, an `.item()`) shows. Both
compare real rows with `torch.testing.assert_close` at `checks.tolerance`. The functions are
`CaptureManager` methods (`_verify`, `_verify_probe`), kept here so the manager reads as steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from graphcap.backends import CapturedGraph
from graphcap.backends.base import flatten_output
from graphcap.batch import GraphKey, probe_batch
from graphcap.buffers import ForwardInputs
from graphcap.errors import CaptureError
from graphcap.piecewise import running

if TYPE_CHECKING:
    from graphcap.manager import CaptureManager

__all__ = ["cloned", "real_rows", "verify_probe", "verify_replay"]


def verify_replay(
    manager: CaptureManager, graph: CapturedGraph, run: Callable[[], Any], inputs: ForwardInputs
) -> float:
    """Replay the capture's own dummy inputs once and compare with `run()` (an eager run of them).

    Returns the seconds the eager run took (capture time that is not graph work).
    """
    return _compare(
        manager,
        graph,
        inputs,
        lambda: real_rows(run(), inputs.num_tokens, inputs.key.num_tokens),
        lambda diff: (
            f"replay differs from eager on the same inputs ({diff}); the forward "
            "depends on something the graph froze (a Python value, a host tensor, randomness)"
        ),
    )


def verify_probe(manager: CaptureManager, graph: CapturedGraph, key: GraphKey) -> float:
    """Replay a second, partly filled batch (other ids, lengths, blocks) and compare its real
    rows with an eager run of it: padded rows run, and a value frozen at capture shows."""
    kv = manager.config.kv_cache
    shape = manager._shape_of(key)
    batch, writes = probe_batch(
        shape,
        max_model_len=kv.max_model_len,
        block_size=kv.block_size,
        num_blocks=kv.num_blocks,
        vocab_size=manager.config.model.vocab_size,
        scratch_blocks=manager._scratch_blocks,
    )
    batch = manager._sampled(batch, 1)
    staging_key = manager.registry.staging_key(key, batch.num_reqs)
    inputs = manager._stage(batch, staging_key, capturing=True, dummy=True, kv_writes=writes)

    def eager() -> Any:
        eager_key = manager.registry.eager_key(batch.num_tokens, batch.num_reqs)
        eager_inputs = manager._stage(batch, eager_key, capturing=True, dummy=True, replay=False, kv_writes=writes)
        # The graph's own code path: a full graph ran the eager ops' capturable stand-ins.
        with running(eager_inputs, "eager" if key.piecewise else "full"):
            return real_rows(manager._forward(eager_inputs), batch.num_tokens, batch.num_tokens)

    return _compare(
        manager,
        graph,
        inputs,
        eager,
        lambda diff: (
            f"replay differs from eager on a partly filled batch ({batch.num_tokens} of {key.num_tokens} "
            f"tokens, {batch.num_reqs} of {shape.num_reqs} requests, other token ids, lengths and blocks: "
            f"{diff}). The graph froze a host value at capture (a Python number read "
            "from inputs.host or inputs.num_tokens / num_reqs, a value prepare() computed, an .item()), "
            "or padded rows leak into real ones. Read per-step values only as tensors of ForwardInputs "
            "(or of your own BufferSpec buffers that prepare() fills), give padded tokens a sink, and "
            "never slice by a Python count"
        ),
    )


def _compare(
    manager: CaptureManager,
    graph: CapturedGraph,
    inputs: ForwardInputs,
    eager: Callable[[], Any],
    message: Callable[[str], str],
) -> float:
    """Replay `graph` on the staged `inputs`, then time `eager()` (the expected real rows) and
    compare; `CaptureError(message(first lines of the difference))` when they differ."""
    with running(inputs):  # eager ops between pieces read the step through current_inputs()
        replayed = cloned(real_rows(graph.replay(), inputs.num_tokens, inputs.key.num_tokens))
    manager.backend.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        expected = eager()
    manager.backend.synchronize()  # time the GPU work, not the launches
    seconds = time.perf_counter() - t0
    try:
        torch.testing.assert_close(replayed, expected, **manager.config.checks.tolerance)
    except AssertionError as exc:
        raise CaptureError(message("; ".join(str(exc).strip().splitlines()[:3]))) from None
    return seconds


def real_rows(output: Any, num_tokens: int, padded: int, what: str = "the forward of") -> Any:
    """`output` (a tensor, or a tuple, list or dict of them) with token-row tensors cut to the real rows.

    A tensor whose leading dim is the padded token count is cut to `[:num_tokens]`; any other
    tensor (a per-request or pooled result) is returned whole.
    """
    leaves, rebuild = flatten_output(output, "this step", what)
    return rebuild([t[:num_tokens] if t.dim() and t.shape[0] == padded else t for t in leaves])


def cloned(output: Any) -> Any:
    leaves, rebuild = flatten_output(output, "this step", "the forward of")
    return rebuild([t.clone() for t in leaves])
