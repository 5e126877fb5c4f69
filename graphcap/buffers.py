"""`PersistentBuffers`: the static inputs every graph reads, and the one path that fills them.

Dummy runs (capture) and real steps both go through `PersistentBuffers.stage`, so there
is no second place to forget a padded tail. The buffers are allocated once at the maxima
and never reallocated: a captured graph keeps reading the addresses it was captured with.

Layout: all int32 metadata lives in one packed array, so with CUDA the host staging is one
pinned array and the upload is one copy. On CPU the tensors *are* the host arrays.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcap.batch import GraphKey, StepBatch
from graphcap.config import PAD_SLOT_ID, PadRules
from graphcap.inputs import FIELDS, ForwardInputs, HostView, StagingLimits

__all__ = ["PAD_SLOT_ID", "ForwardInputs", "HostView", "PadRules", "PersistentBuffers", "StagingLimits"]

# Poisoned buffers hold this before each staging: any padded row the pad rules forgot
# stays at it, an absurd value that invariants and kernels trip over at once.
POISON = np.int32(-0x41414142)
_MAX_CACHED_VIEWS = 1024


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` through a ufunc loop instead of memcpy.

    Above 2 KiB glibc's memcpy uses `rep movsb`, which on some x86 CPUs (AMD Zen 3, glibc
    2.36 here) runs 10x slower when `dst` lies 1-63 bytes after `src` modulo 4 KiB. Where the
    scheduler's arrays sit decides that, so plain assignment made staging slow for some
    allocations only (a 64 KB block table: 2 us or 25 us). The ufunc costs the same at any
    offset. Values were range-checked by `StepBatch`, so the cast to int32 is exact. Below
    2 KiB memcpy never uses `rep movsb`, and plain assignment is the cheaper call.
    """
    if src.nbytes > 2048:
        np.positive(src, out=dst)
    else:
        dst[...] = src


class PersistentBuffers:
    """Static input buffers allocated once at the maxima; `stage()` fills them for a step.

    Does not decide keys (the manager's registry does) and does not run the model. Not
    thread-safe: one staging at a time (the manager holds a lock around stage + replay).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks_per_req: int,
        device: torch.device | str = "cpu",
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        pad_rules: PadRules | None = None,
        poison: bool = False,
    ) -> None:
        for name, value in (
            ("max_num_reqs", max_num_reqs),
            ("max_num_tokens", max_num_tokens),
            ("max_blocks_per_req", max_blocks_per_req),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PersistentBuffers: {name} must be an integer >= 1; got {value!r}")
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        self.limits = StagingLimits(
            block_size, max_blocks_per_req, num_blocks, vocab_size, max_model_len, pad_rules or PadRules()
        )
        self.poison = poison
        R, T, B = max_num_reqs, max_num_tokens, max_blocks_per_req
        sizes = {
            "query_start_loc": R + 1,
            "seq_lens": R,
            "input_ids": T,
            "positions": T,
            "slot_mapping": T,
            "block_table": R * B,
        }
        self._offsets: dict[str, int] = {}
        total = 0
        for name in FIELDS:
            self._offsets[name] = total
            total += sizes[name]
        on_cuda = self.device.type == "cuda"
        # Pinned host staging lets the upload run asynchronously with one copy.
        host = torch.zeros(total, dtype=torch.int32, pin_memory=on_cuda)
        self._host_tensor = host
        self._host = host.numpy()
        self._device_tensor = host.to(self.device) if on_cuda else host
        self._copy_done = None  # CUDA event of the last upload; host writes wait for it
        self._arange = np.arange(max(T, R) + 1, dtype=np.int32)
        o = self._offsets
        self._h_qsl = self._host[o["query_start_loc"] : o["query_start_loc"] + R + 1]
        self._h_seq = self._host[o["seq_lens"] : o["seq_lens"] + R]
        self._h_ids = self._host[o["input_ids"] : o["input_ids"] + T]
        self._h_pos = self._host[o["positions"] : o["positions"] + T]
        self._h_slot = self._host[o["slot_mapping"] : o["slot_mapping"] + T]
        self._h_bt = self._host[o["block_table"] :].reshape(R, B)
        self._h_bt_flat = self._host[o["block_table"] :]
        # Scratch for the slot computation (outside the packed buffer, so a refused batch
        # never touches it) and each request's first entry in the flat block table.
        self._scratch = np.zeros(T, dtype=np.int32)
        self._flat_index = np.zeros(T, dtype=np.intp)
        self._row_base = np.arange(R, dtype=np.intp) * B
        # Views of the first n tokens / r requests, made once per count: a step then slices
        # nothing (each numpy slice costs about as much as a small ufunc call).
        self._token_rows: list[tuple | None] = [None] * (T + 1)
        self._request_rows: list[tuple | None] = [None] * (R + 1)
        self._views: dict[tuple[int, int], tuple] = {}
        self._fill_padding(GraphKey(T, R, False), 0, 0)

    @classmethod
    def from_config(cls, config, device: torch.device | str | None = None) -> PersistentBuffers:
        """Buffers sized from a `CaptureConfig` (batching maxima, KV cache, pad rules)."""
        kv = config.kv_cache
        return cls(
            config.batching.max_num_seqs,
            config.batching.max_num_tokens,
            kv.max_blocks_per_req,
            device if device is not None else "cpu",
            block_size=kv.block_size,
            num_blocks=kv.num_blocks,
            vocab_size=config.model.vocab_size,
            max_model_len=kv.max_model_len,
            pad_rules=config.padding,
            poison=config.checks.poison_padding,
        )

    # -- staging ---------------------------------------------------------------------------

    def stage(self, batch: StepBatch, key: GraphKey) -> ForwardInputs:
        """Fill the buffers for `batch` padded to `key` and return the views for `key`.

        Real rows come from the batch; padded rows follow `limits.pad`. Every check runs
        before the first write: a refused batch (`ValueError` naming the field and request)
        leaves the buffers byte-identical.
        """
        self._check_fits(batch, key)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last upload still reads the pinned staging
        if self.poison:
            self._host.fill(POISON)
        n, r = batch.num_tokens, batch.num_reqs
        q, s = batch.query_lens, batch.seq_lens
        bs = self.limits.block_size
        # The hot path counts numpy calls, not elements: cached views, writes in place with
        # out=, and no temporaries for pure decode.
        ids, pos, slot, blk, flat, token_index = self._token_rows[n] or self._make_token_rows(n)
        qsl, qsl_from_1, seq, table, row_base, req_index = self._request_rows[r] or self._make_request_rows(r)
        decode = batch.max_query_len == 1
        if decode:  # pure decode: request i owns token i, at its last position
            _copy(qsl, req_index)
            np.subtract(s, 1, out=pos)
        else:
            qsl[0] = 0
            np.cumsum(q, out=qsl_from_1)
            # position = seq_len - query_len + (token index - request start)
            np.add(np.repeat(s - q - qsl[:r], q), token_index, out=pos)
        _copy(seq, s)
        if batch.input_ids is None:
            ids.fill(0)
        else:
            _copy(ids, batch.input_ids)
        bt = batch.block_table
        if bt is None:
            np.remainder(pos, bs, out=slot)  # the null block 0
            table[:] = 0
        else:
            width = bt.shape[1]
            if width == self.max_blocks_per_req:
                _copy(table, bt)
            else:
                _copy(table[:, :width], bt)
                table[:, width:] = self.limits.pad.block_id
            # slot = block_table[req, blk] * bs + pos % bs with blk = pos // bs, computed as
            # (block_table[req, blk] - blk) * bs + pos; gathered from the rows just staged
            # (contiguous, row stride max_blocks_per_req).
            np.floor_divide(pos, bs, out=blk)
            np.add(blk, row_base if decode else np.repeat(row_base, q), out=flat)
            # Indices are in range (checked above), so "clip" never changes one; it skips
            # the buffered bounds check of the default mode.
            self._h_bt_flat.take(flat, out=slot, mode="clip")
            np.subtract(slot, blk, out=slot)
            np.multiply(slot, bs, out=slot)
            np.add(slot, pos, out=slot)
        if n < key.num_tokens or r < key.num_reqs:
            self._fill_padding(key, n, r)
        views = self._views_for(key)
        if self._device_tensor is not self._host_tensor:
            self._upload(key)
        return ForwardInputs(*views[:6], n, r, key, views[6], self.limits)

    def _make_token_rows(self, n: int) -> tuple:
        # n <= max_num_tokens: _check_fits ran first.
        rows = (
            self._h_ids[:n],
            self._h_pos[:n],
            self._h_slot[:n],
            self._scratch[:n],
            self._flat_index[:n],
            self._arange[:n],
        )
        self._token_rows[n] = rows
        return rows

    def _make_request_rows(self, r: int) -> tuple:
        rows = (
            self._h_qsl[: r + 1],
            self._h_qsl[1 : r + 1],
            self._h_seq[:r],
            self._h_bt[:r],
            self._row_base[:r],
            self._arange[: r + 1],
        )
        self._request_rows[r] = rows
        return rows

    def _fill_padding(self, key: GraphKey, n: int, r: int) -> None:
        """Write every padded row `[real : padded]` from the pad rules (the only place)."""
        pad = self.limits.pad
        T, R = key.num_tokens, key.num_reqs
        if r < R:
            tail = self._h_qsl[r + 1 : R + 1]
            if pad.query_len == 0 or n == T:
                tail[:] = n  # padded requests are empty: offsets repeat the last real one
            else:
                np.minimum(n + pad.query_len * self._arange[1 : R - r + 1], T, out=tail)
            self._h_seq[r:R] = pad.seq_len
            self._h_bt[r:R] = pad.block_id
        if n < T:
            self._h_ids[n:T] = pad.token_id
            self._h_pos[n:T] = pad.position
            self._h_slot[n:T] = pad.slot

    def _check_fits(self, batch: StepBatch, key: GraphKey) -> None:
        T, R = key.num_tokens, key.num_reqs
        lim = self.limits
        if batch.num_tokens > self.max_num_tokens:
            raise ValueError(
                f"batch has {batch.num_tokens} tokens, above batching.max_num_tokens {self.max_num_tokens}; "
                "the scheduler must split the step"
            )
        if batch.num_reqs > self.max_num_reqs:
            raise ValueError(
                f"batch has {batch.num_reqs} requests, above batching.max_num_seqs {self.max_num_reqs}; "
                "the scheduler must split the step"
            )
        if self.max_num_tokens < T or self.max_num_reqs < R or T < 0 or R < 0:
            raise ValueError(
                f"{key} exceeds the buffers (max_num_tokens {self.max_num_tokens}, max_num_reqs {self.max_num_reqs})"
            )
        if batch.num_tokens > T:
            raise ValueError(f"batch has {batch.num_tokens} tokens but {key} holds {T}")
        if batch.num_reqs > R:
            raise ValueError(f"batch has {batch.num_reqs} requests but {key} holds {R}")
        if key.uniform and R and not batch.is_uniform(T // R):
            raise ValueError(
                f"{key} needs every request to have {T // R} tokens; the batch has query_lens "
                f"from {batch.min_query_len} to {batch.max_query_len}: stage it with a mixed key"
            )
        if lim.max_model_len is not None and batch.max_seq_len > lim.max_model_len:
            i = int(np.argmax(batch.seq_lens > lim.max_model_len))
            raise ValueError(
                f"seq_lens[{i}] is {int(batch.seq_lens[i])}, above max_model_len "
                f"{lim.max_model_len} (kv_cache.max_model_len); finish or truncate the request"
            )
        ids = batch.input_ids
        if ids is not None and lim.vocab_size is not None and batch.max_token_id >= lim.vocab_size:
            t = int(np.argmax(ids >= lim.vocab_size))
            req = int(np.searchsorted(np.cumsum(batch.query_lens), t, side="right"))
            raise ValueError(
                f"input_ids[{t}] (request {req}) is {int(ids[t])}, outside the vocabulary "
                f"[0, {lim.vocab_size}) (model.vocab_size)"
            )
        bt = batch.block_table
        if bt is not None and batch.num_reqs:
            width = bt.shape[1]
            if width > self.max_blocks_per_req:
                raise ValueError(
                    f"block_table has {width} columns; the buffers hold {self.max_blocks_per_req} "
                    f"per request (kv_cache.max_model_len / block_size)"
                )
            if lim.num_blocks is not None and batch.max_block_id >= lim.num_blocks:
                i, j = np.argwhere(bt >= lim.num_blocks)[0]
                raise ValueError(
                    f"block_table[{i}, {j}] is {int(bt[i, j])}, outside the KV cache "
                    f"[0, {lim.num_blocks}) (kv_cache.num_blocks)"
                )
            if batch.max_seq_len > width * lim.block_size:
                need = -(-batch.seq_lens // lim.block_size)
                i = int(np.argmax(need > width))
                raise ValueError(
                    f"request {i} has seq_len {int(batch.seq_lens[i])}, which needs {int(need[i])} "
                    f"blocks of {lim.block_size}, but block_table has {width} columns"
                )

    # -- views and upload ------------------------------------------------------------------

    def _views_for(self, key: GraphKey) -> tuple:
        views = self._views.get((key.num_tokens, key.num_reqs))
        if views is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.pop(next(iter(self._views)))
            T, R = key.num_tokens, key.num_reqs
            o, dev = self._offsets, self._device_tensor
            B = self.max_blocks_per_req
            tensors = (
                dev[o["input_ids"] : o["input_ids"] + T],
                dev[o["positions"] : o["positions"] + T],
                dev[o["slot_mapping"] : o["slot_mapping"] + T],
                dev[o["query_start_loc"] : o["query_start_loc"] + R + 1],
                dev[o["seq_lens"] : o["seq_lens"] + R],
                dev[o["block_table"] : o["block_table"] + R * B].view(R, B),
            )
            host = HostView(
                self._h_ids[:T],
                self._h_pos[:T],
                self._h_slot[:T],
                self._h_qsl[: R + 1],
                self._h_seq[:R],
                self._h_bt[:R],
            )
            views = (*tensors, host)
            self._views[(key.num_tokens, key.num_reqs)] = views
        return views

    def _upload(self, key: GraphKey) -> None:
        # One copy covers every staged row: the block table is last in the layout.
        end = self._offsets["block_table"] + key.num_reqs * self.max_blocks_per_req
        self._device_tensor[:end].copy_(self._host_tensor[:end], non_blocking=True)
        if self._copy_done is None:
            self._copy_done = torch.cuda.Event()
        self._copy_done.record()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The persistent device tensors (whole, at the maxima) by name."""
        return {"packed": self._device_tensor}

    @property
    def nbytes(self) -> int:
        """Bytes of the packed metadata (each of host and device on CUDA)."""
        return self._host.nbytes
