"""What a captured graph reads, found from its recording, guarded like a parameter; a forward that keeps a
tensor it allocates on every call refused at capture.

`StaticGuard` records what the model declares (`graphcap.checks.statics.reach`: parameters, buffers,
submodules, `register_static`). An engine keeps state elsewhere too: nano-vllm sets each layer's KV cache as a
plain attribute (`Attention.k_cache`, no registered buffer), vLLM binds a list. The recording knows better:
every tensor that existed before capture and that the captured ops read or write (`CapturedGraph.reads`,
collected by `graphcap.backends.reads.ExternalReads` in the emulated backend's recording, and in the preflight
that warms up every CUDA capture and every piecewise one). `watch_recording` adds each one the guard does not
hold yet, named where the model keeps it (`model.layers[3].attn.k_cache`, found by
`graphcap.checks.statics.held_tensors`: module attributes, lists, dicts, plain objects) or, where no path is
found, by its shape (`recorded tensor [4, 16] float32 at 0x...`, its storage still checked). Replacing it in its slot,
or swapping its storage, is then refused before the next replay (`StaticInputMovedError`, naming it), as for a
parameter. graphcap's own staging is recorded already and is left out.

A forward that allocates a new tensor on every call and keeps it (`self.kv = torch.zeros(...)` inside
`forward`) makes every capture read the allocation of that capture while the model keeps another after each
step: `watch_recording` sees a tensor the model holds after the capture that it did not hold before, and the
key is refused (`CaptureError` naming the attribute), instead of a first `execute` advising a re-capture that
allocates again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from graphcap.backends import CapturedGraph
from graphcap.checks.guard import StaticGuard
from graphcap.checks.statics import Reached, held_tensors
from graphcap.errors import CaptureError

__all__ = ["watch_recording"]


def watch_recording(
    guard: StaticGuard, model: Any, staging: Mapping[str, torch.Tensor], what: str
) -> Callable[[CapturedGraph], None]:
    """Call before capturing `what` (a key); call what it returns with the captured graph, which raises
    `CaptureError` for a tensor the model started holding during the capture, and
    otherwise hands the graph's `reads` to `guard` (see the module docstring)."""
    before = set(held_tensors(model))

    def captured(graph: CapturedGraph) -> None:
        held = held_tensors(model)
        new = [r for identity, r in held.items() if identity not in before]
        if new:  # the caller's failure policy releases the graph
            r = new[0]
            raise CaptureError(
                f"{r.name} holds a tensor the forward allocated while {what} was captured (a {r.what} the forward "
                "sets on every call, e.g. `self.kv = torch.zeros(...)`): the graph writes the one of its capture, "
                "every step after it another; allocate it once before capture (in __init__, or register_buffer) "
                "and write into it in place (copy_, index_copy_)"
            )
        reads, graph.reads = graph.reads, None
        if reads and guard.is_armed:
            _adopt(guard, reads, held, staging)

    return captured


def _adopt(
    guard: StaticGuard, reads: tuple[torch.Tensor, ...], held: dict[int, Reached], staging: Mapping[str, torch.Tensor]
) -> None:
    staged = {t.untyped_storage().data_ptr() for t in staging.values()}
    known = guard.recorded_ids()
    for tensor in reads:
        if id(tensor) in known:
            continue
        try:
            storage = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage of its own: `reach` names what holds it
            continue
        if storage in staged:
            continue
        r = held.get(id(tensor))
        if r is None:
            dtype = str(tensor.dtype).removeprefix("torch.")
            r = Reached(f"recorded tensor {list(tensor.shape)} {dtype} at {storage:#x}",
                        tensor, None, None, "tensor the graph reads")  # fmt: skip
        guard.add_read(r)
