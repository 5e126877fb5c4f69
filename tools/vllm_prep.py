"""vLLM v1's host-side per-step input preparation, re-implemented with numpy: a benchmark peer for graphcap.

What it models: `GPUModelRunner._prepare_inputs` of vLLM v1 in its host-computed form (the
0.10.x releases, mid to late 2025, with `CpuGpuBuffer` and `BlockTable.compute_slot_mapping`
in numpy; later releases moved positions, seq_lens and the slot mapping into GPU kernels).
The data layout is vLLM's: a persistent input batch with arrays preallocated at the maxima
(`token_ids_cpu` [max_num_reqs, max_model_len], `num_computed_tokens_cpu`, a `BlockTable`
with `block_table_np` [max_num_reqs, max_num_blocks_per_req] and `slot_mapping_np`), the
runner's `arange_np`, `input_ids`, `positions`, `query_start_loc` and `seq_lens` buffers, and
live requests in rows 0..num_reqs-1. Dtypes follow vLLM: positions and slot_mapping are
int64, everything else int32. This is an independent port written from how vLLM works, not a
copy of its code; each step below was checked against vLLM's `gpu_model_runner.py` and
`block_table.py` of those releases.

Each buffer pairs a host tensor (`.cpu`, with a numpy view `.np`) with a "device" twin
(`.gpu`). With `copies=True` (the default) on a CPU run the twin is a second CPU tensor, so
every host->device upload vLLM issues is a real `copy_` of the same rows; with
`device="cuda"` the host side is pinned and the copies are asynchronous, as in vLLM. With
`copies=False` nothing is uploaded: the step is the metadata computation alone, and
`metadata()` reads the host buffers (the stricter peer for graphcap: see below).

Per step (`VllmStylePrep.prepare_inputs`), in vLLM's order, included:

1. `block_table.commit_block_table(num_reqs)`: upload rows `[:num_reqs]` of the block table
   (first, so that on a GPU the copy overlaps the numpy work below). [copies]
2. `req_indices = np.repeat(arange_np[:num_reqs], num_scheduled_tokens)`.
3. `_get_cumsum_and_arange`: `cu_num_tokens = np.cumsum(num_scheduled_tokens)` and each
   token's offset in its request (`arange_np[:T]` minus the repeated request starts).
4. `positions_np = num_computed_tokens_cpu[req_indices] + offsets`, written into the
   persistent `positions` host buffer.
5. Token ids: flat indices `positions + req_indices * max_model_len` into `token_ids_cpu`,
   gathered with `torch.index_select(..., out=input_ids.cpu[:T])` (vLLM uses
   `index_select` here, not `np.take`, because it is faster on large tables).
6. `block_table.compute_slot_mapping(req_indices, positions)`: `block_numbers =
   block_table_np.ravel()[req_indices * max_num_blocks_per_req + positions // block_size]`,
   `slot = block_numbers * block_size + positions % block_size` into `slot_mapping_np[:T]`;
   then `commit_slot_mapping(T)` (upload `[:T]`). [upload: copies]
7. `query_start_loc_np[0] = 0`, `query_start_loc_np[1:num_reqs+1] = cu_num_tokens`; the
   padded tail `query_start_loc_np[num_reqs+1:]` filled with the last offset and the
   whole-buffer upload `query_start_loc.copy_to_gpu()` (vLLM passes no count). [tail and
   upload: copies]
8. `seq_lens_np[:num_reqs] = num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens`; the
   tail `seq_lens_np[num_reqs:]` filled with 0 and the whole-buffer upload
   `seq_lens.copy_to_gpu()` [tail and upload: copies]; `max_seq_len =
   seq_lens_np[:num_reqs].max().item()` (host work the attention metadata needs).
9. `input_ids.copy_to_gpu(T)` (`_prepare_input_ids` without async scheduling) and
   `positions.copy_to_gpu(T)` (1-D positions). [copies]

The two tail fills belong with the uploads: those releases fill the host tails so that the
whole-buffer uploads carry right padding (earlier releases filled the device tails with
`fill_` after the upload instead). Without uploads they have nothing to prepare.

Omitted, and why (each omission makes the peer cheaper, so graphcap's ratios are upper bounds):

- Building `num_scheduled_tokens` from the scheduler output's per-request dict (a Python
  loop over the requests in vLLM) and `max_num_scheduled_tokens`: this step takes the int32
  array directly, as graphcap's step takes numpy arrays.
- The discard mask of partial prefills (`num_tokens` of every request gathered in a Python
  list, compared with `seq_lens`, `np.nonzero`, uploaded): O(requests) Python per step.
- `_update_states` (per-request bookkeeping before `_prepare_inputs`: new requests, appended
  sampled tokens and blocks, updated `num_computed_tokens`): it is setup here
  (`InputBatch.add_request` / `update_request`, untimed), because graphcap's inputs arrive
  as whole arrays every step. In vLLM it is per-step host work too.
- Features this comparison does not exercise: M-RoPE, prompt embeddings, speculative
  decoding metadata, LoRA, cascade attention, DP/micro-batch padding, CUDA-graph dispatch,
  the attention backends' `build()`, and `logits_indices = query_start_loc[1:] - 1` (a
  device op). The device-side `slot_mapping.gpu[T:].fill_(-1)` done when the attention
  metadata is built is a kernel launch, not host work; with `copies=True` the "device"
  slot tail holds whatever the host tail held: read only the real rows.

Use: `load_step(prep, query_lens, seq_lens, input_ids, block_table)` loads graphcap-style
inputs into the persistent batch (untimed) and returns a `LoadedStep` whose zero-argument
`step()` does exactly the per-step work above and whose `metadata()` reads the step's rows.

Timing note: time it with one torch intra-op thread (`torch.set_num_threads(1)`), as vLLM's
multiprocess workers run unless OMP_NUM_THREADS is set. With more, every large `copy_` is an
OpenMP region, which stalls for a scheduler slice (milliseconds) when another process holds
one of the cores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from _vllm_batch import BlockTable, CpuGpuBuffer, InputBatch

__all__ = [
    "METADATA_FIELDS",
    "BlockTable",
    "CpuGpuBuffer",
    "InputBatch",
    "LoadedStep",
    "VllmStylePrep",
    "graphcap_real_rows",
    "load_step",
    "metadata_mismatches",
]

METADATA_FIELDS = ("query_start_loc", "seq_lens", "positions", "slot_mapping", "input_ids", "block_table")
"""The per-step metadata both implementations produce, compared on their real rows."""


class VllmStylePrep:
    """The runner's persistent buffers and `prepare_inputs`, the per-step host work of vLLM v1.

    Buffers (host `.np`/`.cpu`, device `.gpu`): `input_ids` [max_num_tokens] int32,
    `positions` [max_num_tokens] int64, `query_start_loc` [max_num_reqs + 1] int32,
    `seq_lens` [max_num_reqs] int32; the block table and slot mapping live in
    `input_batch.block_table`. Not thread-safe; one step at a time.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        *,
        copies: bool = True,
    ) -> None:
        self.copies = copies
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.input_batch = InputBatch(max_num_reqs, max_model_len, max_num_tokens, block_size, device)
        # arange_np: [max(max_num_reqs + 1, max_model_len, max_num_tokens)] int64, one arange for
        # request indices and token offsets alike.
        self.arange_np = np.arange(max(max_num_reqs + 1, max_model_len, max_num_tokens), dtype=np.int64)
        self.input_ids = CpuGpuBuffer(max_num_tokens, dtype=torch.int32, device=device)  # [T]
        self.positions = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)  # [T]
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, dtype=torch.int32, device=device)  # [R+1]
        self.seq_lens = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)  # [R]
        self.query_start_loc_np = self.query_start_loc.np
        self.seq_lens_np = self.seq_lens.np
        self.positions_np = self.positions.np
        self.max_seq_len = 0

    def _get_cumsum_and_arange(self, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`([2, 5, 3]) -> ([2, 7, 10], [0, 1, 0, 1, 2, 3, 4, 0, 1, 2])`: end offsets and per-request aranges.

        One cumsum, one repeat and one subtraction instead of an arange per request.
        """
        cu_num_tokens = np.cumsum(num_tokens)  # [R] int64
        total_num_tokens = cu_num_tokens[-1]
        # Each token's request start: [0, 0, 2, 2, 2, 2, 2, 7, 7, 7].
        cumsums_offsets = np.repeat(cu_num_tokens - num_tokens, num_tokens)  # [T]
        arange = self.arange_np[:total_num_tokens] - cumsums_offsets  # [T]
        return cu_num_tokens, arange

    def prepare_inputs(self, num_scheduled_tokens: np.ndarray, total_num_scheduled_tokens: int) -> None:
        """One step of vLLM's host-side input preparation (the steps in the module docstring).

        `num_scheduled_tokens`: int32 [num_reqs], tokens of each live request this step (>= 1),
        in row order; `total_num_scheduled_tokens`: their sum (the scheduler hands it over).
        Each request's positions must stay below its row's blocks * block_size and below
        max_model_len; like vLLM, nothing is checked here (the scheduler guarantees it).
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        block_table = batch.block_table
        copies = self.copies
        # Upload the block table first: on a GPU the copy then overlaps the numpy work below.
        if copies:
            block_table.commit_block_table(num_reqs)

        # The request of each token: [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2].
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)  # [T]
        cu_num_tokens, arange = self._get_cumsum_and_arange(num_scheduled_tokens)  # [R], [T]

        # positions: [T] int64, written into the persistent host buffer.
        positions_np = self.positions.np[:total_num_scheduled_tokens]
        np.add(batch.num_computed_tokens_cpu[req_indices], arange, out=positions_np)

        # Flat indices into token_ids_cpu, whose rows are max_model_len wide.
        token_indices = positions_np + req_indices * batch.token_ids_cpu.shape[1]  # [T]
        torch.index_select(
            batch.token_ids_cpu_tensor.flatten(),
            0,
            torch.from_numpy(token_indices),
            out=self.input_ids.cpu[:total_num_scheduled_tokens],
        )

        block_table.compute_slot_mapping(req_indices, positions_np)
        if copies:
            block_table.commit_slot_mapping(total_num_scheduled_tokens)

        query_start_loc_np = self.query_start_loc.np
        query_start_loc_np[0] = 0
        query_start_loc_np[1 : num_reqs + 1] = cu_num_tokens
        if copies:
            # Padded tail non-decreasing (kernels need it), then the whole-buffer upload.
            query_start_loc_np[num_reqs + 1 :].fill(cu_num_tokens[-1])
            self.query_start_loc.copy_to_gpu()

        self.seq_lens.np[:num_reqs] = batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens
        if copies:
            self.seq_lens.np[num_reqs:].fill(0)
            self.seq_lens.copy_to_gpu()
        self.max_seq_len = self.seq_lens.np[:num_reqs].max().item()

        if copies:
            self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
            self.positions.copy_to_gpu(total_num_scheduled_tokens)

    def metadata(self, num_reqs: int, num_tokens: int) -> dict[str, np.ndarray]:
        """The step's real rows as numpy arrays: the uploaded copies (with `copies`), else the host buffers.

        `query_start_loc[:num_reqs+1]`, `seq_lens[:num_reqs]`, `positions[:num_tokens]`,
        `slot_mapping[:num_tokens]`, `input_ids[:num_tokens]`, `block_table[:num_reqs]` (all
        `max_num_blocks_per_req` columns). On the CPU these are views: valid until the next step.
        """
        block_table = self.input_batch.block_table
        side = "gpu" if self.copies else "cpu"
        buffers = {
            "query_start_loc": (self.query_start_loc, num_reqs + 1),
            "seq_lens": (self.seq_lens, num_reqs),
            "positions": (self.positions, num_tokens),
            "slot_mapping": (block_table.slot_mapping, num_tokens),
            "input_ids": (self.input_ids, num_tokens),
            "block_table": (block_table.block_table, num_reqs),
        }
        return {name: getattr(buffer, side)[:rows].cpu().numpy() for name, (buffer, rows) in buffers.items()}


@dataclass(frozen=True)
class LoadedStep:
    """A step loaded into a `VllmStylePrep`: `step()` is the timed per-step work, `metadata()` its result."""

    prep: VllmStylePrep
    step: Callable[[], None]
    num_reqs: int
    num_tokens: int

    def metadata(self) -> dict[str, np.ndarray]:
        """The real rows of the last `step()` (see `VllmStylePrep.metadata`)."""
        return self.prep.metadata(self.num_reqs, self.num_tokens)


def load_step(
    prep: VllmStylePrep,
    query_lens: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    input_ids: Sequence[int] | np.ndarray,
    block_table: Sequence[Sequence[int]] | np.ndarray,
) -> LoadedStep:
    """Load one graphcap-style step into `prep`'s persistent batch (setup, untimed).

    Inputs as graphcap's `StepBatch`: `query_lens[i]` tokens of request i this step,
    `seq_lens[i]` its length including them (so `num_computed_tokens = seq_len - query_len`),
    `input_ids` the `sum(query_lens)` new tokens in request order, `block_table` [num_reqs,
    width] with `width * block_size >= max(seq_lens)`. Request i goes to row i: its new tokens
    to `token_ids_cpu[i, num_computed:seq_len]` (earlier tokens, which graphcap's inputs do not
    carry, are left 0: this step never reads them) and all `width` block ids of its row to the
    block table, so the uploaded rows match graphcap's `block_table[:, :width]`. Replaces
    whatever `prep` held. Raises ValueError for inputs vLLM's scheduler would never produce.
    """
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    ids = np.asarray(input_ids, dtype=np.int64)
    bt = np.asarray(block_table, dtype=np.int64)
    batch = prep.input_batch
    bs = batch.block_table.block_size
    num_reqs = len(q)
    if q.ndim != 1 or s.shape != q.shape:
        raise ValueError(f"query_lens {q.shape} and seq_lens {s.shape} must be 1-D of the same length")
    if not 1 <= num_reqs <= prep.max_num_reqs:
        raise ValueError(f"{num_reqs} requests; vLLM needs 1..{prep.max_num_reqs} (max_num_reqs)")
    if q.min() < 1 or (s < q).any():
        raise ValueError("every query_len must be >= 1 and <= its seq_len")
    num_tokens = int(q.sum())
    if num_tokens > prep.max_num_tokens or ids.shape != (num_tokens,):
        raise ValueError(f"{ids.shape} input ids for {num_tokens} tokens (max_num_tokens {prep.max_num_tokens})")
    if bt.ndim != 2 or bt.shape[0] != num_reqs or bt.shape[1] * bs < s.max():
        raise ValueError(f"block_table {bt.shape} cannot hold {num_reqs} requests of up to {s.max()} tokens")
    batch.clear()
    starts = np.cumsum(q) - q
    for i in range(num_reqs):
        num_computed = int(s[i] - q[i])
        tokens = np.zeros(int(s[i]), dtype=np.int32)  # token_ids of row i: [seq_len]
        tokens[num_computed:] = ids[starts[i] : starts[i] + q[i]]
        batch.add_request(tokens, num_computed, bt[i])
    # What vLLM builds from the scheduler output each step: int32 tokens per row, and the total.
    num_scheduled_tokens = q.astype(np.int32)  # [R]
    prepare = prep.prepare_inputs

    def step() -> None:
        prepare(num_scheduled_tokens, num_tokens)

    return LoadedStep(prep, step, num_reqs, num_tokens)


def graphcap_real_rows(host, num_reqs: int, num_tokens: int, width: int) -> dict[str, np.ndarray]:
    """The real rows of a graphcap `HostView` (`ForwardInputs.host`), keyed like `VllmStylePrep.metadata`.

    The block table is cut to the batch's `width` columns (graphcap pads later columns).
    """
    return {
        "query_start_loc": host.query_start_loc[: num_reqs + 1],
        "seq_lens": host.seq_lens[:num_reqs],
        "positions": host.positions[:num_tokens],
        "slot_mapping": host.slot_mapping[:num_tokens],
        "input_ids": host.input_ids[:num_tokens],
        "block_table": host.block_table[:num_reqs, :width],
    }


def metadata_mismatches(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], width: int) -> list[str]:
    """Names of the fields whose values differ (dtypes may: vLLM keeps positions and slots in int64).

    `actual["block_table"]` is compared on its first `width` columns.
    """
    bad = []
    for name in METADATA_FIELDS:
        got = actual[name][:, :width] if name == "block_table" else actual[name]
        if not np.array_equal(expected[name], got):
            bad.append(name)
    return bad
