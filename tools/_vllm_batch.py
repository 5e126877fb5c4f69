"""vLLM v1's persistent input batch, in numpy and torch: the data layout `vllm_prep.VllmStylePrep` steps over.

`CpuGpuBuffer` (a host tensor, its numpy view, a device twin), `BlockTable` (block ids per
request row and the slot mapping) and `InputBatch` (token ids and computed counts per row,
live requests in rows 0..num_reqs-1), each modelled on the vLLM class of the same name; see
`vllm_prep`'s docstring for the releases it follows and what it leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockTable", "CpuGpuBuffer", "InputBatch"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CpuGpuBuffer:
    """A host tensor, its numpy view and a device twin, like `vllm.v1.utils.CpuGpuBuffer`.

    `.cpu` is the host tensor (pinned when `device` is CUDA), `.np` a numpy view of it (writes
    through), `.gpu` a separate tensor of the same shape on `device` (on the CPU: a second
    CPU tensor). `copy_to_gpu(n)` copies rows `[:n]`, or everything when `n` is None.
    """

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        # A distinct allocation even on the CPU: the upload must be a real copy.
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class BlockTable:
    """Per-request KV-cache block ids and the slot mapping, like vLLM's `BlockTable`.

    Row `i` holds request `i`'s block ids in its first `num_blocks_per_row[i]` columns; later
    columns are stale and never read for a valid request (its positions stay below
    `num_blocks_per_row[i] * block_size`). One KV-cache group, kernel block size equal to the
    allocation block size, no context parallelism.
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        # block_table: [max_num_reqs, max_num_blocks_per_req] int32
        self.block_table = CpuGpuBuffer(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device)
        self.block_table_np = self.block_table.np
        # num_blocks_per_row: [max_num_reqs]
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        # slot_mapping: [max_num_batched_tokens] int64
        self.slot_mapping = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int64, device=device)
        self.slot_mapping_np = self.slot_mapping.np

    # -- setup (vLLM calls these from `_update_states`, before `_prepare_inputs`) ------------

    def append_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Append `block_ids` after the blocks row `row_idx` already holds."""
        num_blocks = len(block_ids)
        if num_blocks == 0:
            return
        start = int(self.num_blocks_per_row[row_idx])
        if start + num_blocks > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row_idx}: {start} + {num_blocks} blocks exceed max_num_blocks_per_req "
                f"{self.max_num_blocks_per_req}"
            )
        self.num_blocks_per_row[row_idx] = start + num_blocks
        self.block_table_np[row_idx, start : start + num_blocks] = block_ids

    def add_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Make row `row_idx` hold exactly `block_ids` (columns after them keep stale values)."""
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    # -- per step ----------------------------------------------------------------------------

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> None:
        """`slot_mapping_np[:T]` = the KV-cache slot of each token (`T = len(req_indices)`).

        Indexes the flat table by `row * max_num_blocks_per_req + position // block_size`:
        the token index into `token_ids_cpu` cannot be reused, because a `token_ids_cpu` row is
        `max_model_len` wide, which need not be a multiple of `block_size`.
        """
        block_table_indices = req_indices * self.max_num_blocks_per_req + positions // self.block_size  # [T]
        block_numbers = self.block_table_np.ravel()[block_table_indices]  # [T] int32
        block_offsets = positions % self.block_size  # [T] int64
        np.add(block_numbers * self.block_size, block_offsets, out=self.slot_mapping_np[: req_indices.shape[0]])

    def commit_block_table(self, num_reqs: int) -> None:
        self.block_table.copy_to_gpu(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        self.slot_mapping.copy_to_gpu(num_tokens)


class InputBatch:
    """The persistent batch: per-request rows preallocated at the maxima, like vLLM's `InputBatch`.

    Only the fields `_prepare_inputs` reads: token ids, token counts, computed-token counts
    and the block table. Live requests occupy rows `0..num_reqs-1` (vLLM condenses the batch
    to keep it so).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # token_ids_cpu: [max_num_reqs, max_model_len] int32 (every token of every request)
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        # num_tokens: [max_num_reqs] (tokens held in each token_ids_cpu row)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # num_computed_tokens_cpu: [max_num_reqs] int32 (tokens already in the KV cache)
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()
        self.block_table = BlockTable(
            block_size, max_num_reqs, _cdiv(max_model_len, block_size), max_num_batched_tokens, device
        )
        self.num_reqs = 0

    def add_request(
        self,
        token_ids: Sequence[int] | np.ndarray,
        num_computed_tokens: int,
        block_ids: Sequence[int] | np.ndarray,
        row: int | None = None,
    ) -> int:
        """Put a request in row `row` (default: the next free row); returns the row.

        Like vLLM's `InputBatch.add_request`: the request's tokens so far (prompt and outputs)
        go to `token_ids_cpu[row, :len(token_ids)]`, its computed-token count to
        `num_computed_tokens_cpu[row]`, its blocks to the block table (`add_row`). A row below
        `num_reqs` is replaced; rows stay contiguous, so `row` may not exceed `num_reqs`.
        """
        row = self.num_reqs if row is None else row
        if not 0 <= row <= self.num_reqs or row >= self.max_num_reqs:
            raise ValueError(f"row {row}: live rows are 0..{self.num_reqs - 1} of {self.max_num_reqs}")
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(f"row {row}: {n} tokens exceed max_model_len {self.max_model_len}")
        if not 0 <= num_computed_tokens <= n:
            raise ValueError(f"row {row}: num_computed_tokens {num_computed_tokens} not in [0, {n}]")
        self.token_ids_cpu[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens_cpu[row] = num_computed_tokens
        self.block_table.add_row(block_ids, row)
        self.num_reqs = max(self.num_reqs, row + 1)
        return row

    def update_request(
        self,
        row: int,
        num_computed_tokens: int,
        new_token_ids: Sequence[int] | np.ndarray = (),
        new_block_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """A running request's per-step update, like vLLM's `_update_states` for cached requests.

        Sets its computed-token count, appends newly sampled tokens after its last token and
        newly allocated blocks after its last block (`BlockTable.append_row`).
        """
        if not 0 <= row < self.num_reqs:
            raise ValueError(f"row {row}: live rows are 0..{self.num_reqs - 1}")
        start, k = int(self.num_tokens[row]), len(new_token_ids)
        if start + k > self.max_model_len:
            raise ValueError(f"row {row}: {start + k} tokens exceed max_model_len {self.max_model_len}")
        if not 0 <= num_computed_tokens <= start + k:
            raise ValueError(f"row {row}: num_computed_tokens {num_computed_tokens} not in [0, {start + k}]")
        self.token_ids_cpu[row, start : start + k] = new_token_ids
        self.num_tokens[row] = start + k
        self.num_computed_tokens_cpu[row] = num_computed_tokens
        self.block_table.append_row(new_block_ids, row)

    def clear(self) -> None:
        """Drop every request (rows are overwritten by the next `add_request`)."""
        self.num_reqs = 0
