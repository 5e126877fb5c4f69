"""`PersistentBuffers`: the static inputs every graph reads, and the one path that fills them.

Dummy runs (capture) and real steps both go through `PersistentBuffers.stage`, so there
is no second place to forget a padded tail. The buffers are allocated once at the maxima
and never reallocated: a captured graph keeps reading the addresses it was captured with.

Layout: every field of `inputs.FIELD_TABLE` and every engine buffer (`BufferSpec`) lives in
one packed byte buffer, each at a 64-byte aligned offset, so with CUDA the host staging is
one pinned array and the upload of a step is one copy of a prefix. On CPU the tensors *are*
the host arrays (zero copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

from graphcap._fastnp import copy_into
from graphcap.batch import GraphKey, StepBatch
from graphcap.config import PAD_SLOT_ID, PadRules
from graphcap.errors import BatchError
from graphcap.inputs import FIELD_TABLE, BufferSpec, ForwardInputs, HostView, StagingLimits

__all__ = ["PAD_SLOT_ID", "POISON", "BufferSpec", "ForwardInputs", "HostView", "PadRules", "PersistentBuffers"]

POISON = np.int32(-0x41414142)
"""What poisoned int32 rows hold before each staging (`checks.poison_padding`): any padded row
the pad rules forgot stays at it, an absurd value that invariants and kernels trip over."""
_ALIGN = 64
_MAX_CACHED_VIEWS = 1024


class PersistentBuffers:
    """Static input buffers allocated once at the maxima; `stage()` fills them for a step.

    Normally `CaptureManager` owns one and calls `stage` for every step and dummy batch.
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
        extras: Iterable[BufferSpec] = (),
    ) -> None:
        for name, value in (
            ("max_num_reqs", max_num_reqs),
            ("max_num_tokens", max_num_tokens),
            ("max_blocks_per_req", max_blocks_per_req),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PersistentBuffers: {name} must be an integer >= 1; got {value!r}")
        extras = tuple(extras)
        _check_extras(extras)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        pad = pad_rules or PadRules()
        self.limits = StagingLimits(block_size, max_blocks_per_req, num_blocks, vocab_size, max_model_len, pad, extras)
        self.extras = extras
        self.poison = poison
        R, T, B = max_num_reqs, max_num_tokens, max_blocks_per_req

        # The layout: (name, full shape, dtype) per field, built-ins then extras, the block
        # table last so that one prefix covers every staged row of a key.
        shapes = {"tokens": T, "reqs": R, "reqs+1": R + 1}
        layout = [
            (f.name, (shapes[f.rows], B) if f.width else (shapes[f.rows],), np.dtype(np.int32)) for f in FIELD_TABLE
        ]
        layout[-1:-1] = [(s.name, _full_shape(s, T, R), s.np_dtype) for s in extras]
        self._offsets: dict[str, int] = {}
        total = 0
        for name, shape, dtype in layout:
            self._offsets[name] = total
            total += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
        on_cuda = self.device.type == "cuda"
        # Pinned host staging lets the upload run asynchronously with one copy.
        host = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
        self._host_tensor = host
        self._packed = host.numpy()
        self._device_tensor = host.to(self.device) if on_cuda else host
        self._copy_done = None  # CUDA event of the last upload; host writes wait for it
        self._layout = layout
        # Full-size host views by name (numpy), and the same on the device (torch).
        self.host: Mapping[str, np.ndarray] = MappingProxyType(
            {name: self._host_array(name, shape, dtype) for name, shape, dtype in layout}
        )
        h = self.host
        self._arange = np.arange(max(T, R) + 1, dtype=np.int32)
        self._h_qsl, self._h_seq, self._h_bt = h["query_start_loc"], h["seq_lens"], h["block_table"]
        self._h_ids, self._h_pos, self._h_slot = h["input_ids"], h["positions"], h["slot_mapping"]
        self._h_bt_flat = self._h_bt.reshape(-1)
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
        self._fill_padding(T, R, 0, 0)
        for spec in extras:
            self._pad_extra(spec, T, R, 0, 0)

    @classmethod
    def from_config(
        cls, config, device: torch.device | str | None = None, *, extras: Sequence[BufferSpec] = ()
    ) -> PersistentBuffers:
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
            extras=extras,
        )

    def _host_array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        start = self._offsets[name]
        return self._packed[start : start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    # -- staging ---------------------------------------------------------------------------

    def stage(self, batch: StepBatch, key: GraphKey, *, upload: bool = True) -> ForwardInputs:
        """Fill the buffers for `batch` padded to `key` and return the views for `key`.

        Real rows come from the batch; padded rows follow `limits.pad` (engine buffers: their
        `pad`). Every check runs before the first write: a refused batch (`BatchError` naming
        the field and request) leaves the buffers byte-identical. `upload=False` leaves the
        device copy to a later `upload(key)` (the manager checks the host rows in between).
        """
        self._check_fits(batch, key)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last upload still reads the pinned staging
        if self.poison:
            self._poison()
        n, r = batch.num_tokens, batch.num_reqs
        T, R = key.num_tokens, key.num_reqs
        q, s = batch.query_lens, batch.seq_lens
        bs = self.limits.block_size
        # The hot path counts numpy calls, not elements: cached views, writes in place with
        # out=, and no temporaries for pure decode.
        ids, pos, slot, blk, flat, token_index = self._token_rows[n] or self._make_token_rows(n)
        qsl, qsl_from_1, seq, table, row_base, req_index = self._request_rows[r] or self._make_request_rows(r)
        decode = batch.max_query_len == 1
        if decode:  # pure decode: request i owns token i, at its last position
            copy_into(qsl, req_index)
            np.subtract(s, 1, out=pos)
        else:
            qsl[0] = 0
            np.cumsum(q, out=qsl_from_1)
            # position = seq_len - query_len + (token index - request start)
            np.add(np.repeat(s - q - qsl[:r], q), token_index, out=pos)
        copy_into(seq, s)
        if batch.input_ids is None:
            ids.fill(0)
        else:
            copy_into(ids, batch.input_ids)
        bt = batch.block_table
        if bt is None:
            np.remainder(pos, bs, out=slot)  # the null block 0
            table[:] = 0
        else:
            width = bt.shape[1]
            if width == self.max_blocks_per_req:
                copy_into(table, bt)
            else:
                copy_into(table[:, :width], bt)
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
        if n < T or r < R:
            self._fill_padding(T, R, n, r)
        for spec in self.extras:
            self._stage_extra(spec, batch.extras.get(spec.name), T, R, n, r)
        views, host, extras, end = self._views_for(key)
        if upload and self._device_tensor is not self._host_tensor:
            self._upload(end)
        return ForwardInputs(*views, n, r, key, host, self.limits, extras)

    def upload(self, key: GraphKey) -> None:
        """Copy the staged host rows of `key` to the device (one copy; nothing on CPU)."""
        if self._device_tensor is not self._host_tensor:
            self._upload(self._views_for(key)[3])

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

    def _fill_padding(self, T: int, R: int, n: int, r: int) -> None:
        """Write every padded row `[real : padded]` of the built-ins from the pad rules (the only place)."""
        pad = self.limits.pad
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

    def _stage_extra(self, spec: BufferSpec, value: np.ndarray | None, T: int, R: int, n: int, r: int) -> None:
        """Real rows of an engine buffer from the batch (checked in `_check_fits`), then its pad."""
        host = self.host[spec.name]
        if spec.rows == "none":
            if value is None:
                host[...] = spec.pad
            else:
                host[...] = value
            return
        real = n if spec.rows == "tokens" else r
        if value is not None and real:
            host[_rows(spec, 0, real)] = value
        self._pad_extra(spec, T, R, n if value is not None else 0, r if value is not None else 0)

    def _pad_extra(self, spec: BufferSpec, T: int, R: int, n: int, r: int) -> None:
        if spec.rows == "none":
            self.host[spec.name][...] = spec.pad
            return
        lo, hi = (n, T) if spec.rows == "tokens" else (r, R)
        if lo < hi:
            self.host[spec.name][_rows(spec, lo, hi)] = spec.pad

    def _poison(self) -> None:
        self._packed.fill(0xBE)  # integer rows read POISON (0xBEBEBEBE as int32)
        for name, _, dtype in self._layout:
            if dtype.kind == "f":
                self.host[name].fill(np.nan)
            elif dtype.kind == "b":
                self.host[name].fill(True)

    def _check_fits(self, batch: StepBatch, key: GraphKey) -> None:
        T, R = key.num_tokens, key.num_reqs
        lim = self.limits
        if batch.num_tokens > self.max_num_tokens:
            raise BatchError(
                f"batch has {batch.num_tokens} tokens, above batching.max_num_tokens {self.max_num_tokens}; "
                "the scheduler must split the step"
            )
        if batch.num_reqs > self.max_num_reqs:
            raise BatchError(
                f"batch has {batch.num_reqs} requests, above batching.max_num_seqs {self.max_num_reqs}; "
                "the scheduler must split the step"
            )
        if self.max_num_tokens < T or self.max_num_reqs < R or T < 0 or R < 0:
            raise BatchError(
                f"{key} exceeds the buffers (max_num_tokens {self.max_num_tokens}, max_num_reqs {self.max_num_reqs})"
            )
        if batch.num_tokens > T or batch.num_reqs > R:
            what, have, hold = (
                ("tokens", batch.num_tokens, T) if batch.num_tokens > T else ("requests", batch.num_reqs, R)
            )
            raise BatchError(f"batch has {have} {what} but {key} holds {hold}")
        if key.uniform and R and not batch.is_uniform(T // R):
            raise BatchError(
                f"{key} needs every request to have {T // R} tokens; the batch has query_lens "
                f"from {batch.min_query_len} to {batch.max_query_len}: stage it with a mixed key"
            )
        if lim.max_model_len is not None and batch.max_seq_len > lim.max_model_len:
            i = int(np.argmax(batch.seq_lens > lim.max_model_len))
            raise BatchError(
                f"seq_lens[{i}] is {int(batch.seq_lens[i])}, above max_model_len "
                f"{lim.max_model_len} (kv_cache.max_model_len); finish or truncate the request"
            )
        ids = batch.input_ids
        if ids is not None and lim.vocab_size is not None and batch.max_token_id >= lim.vocab_size:
            t = int(np.argmax(ids >= lim.vocab_size))
            req = int(np.searchsorted(np.cumsum(batch.query_lens), t, side="right"))
            raise BatchError(
                f"input_ids[{t}] (request {req}) is {int(ids[t])}, outside the vocabulary "
                f"[0, {lim.vocab_size}) (model.vocab_size)"
            )
        bt = batch.block_table
        if bt is not None and batch.num_reqs:
            width = bt.shape[1]
            if width > self.max_blocks_per_req:
                raise BatchError(
                    f"block_table has {width} columns; the buffers hold {self.max_blocks_per_req} "
                    f"per request (kv_cache.max_model_len / block_size)"
                )
            if lim.num_blocks is not None and batch.max_block_id >= lim.num_blocks:
                i, j = np.argwhere(bt >= lim.num_blocks)[0]
                raise BatchError(
                    f"block_table[{i}, {j}] is {int(bt[i, j])}, outside the KV cache "
                    f"[0, {lim.num_blocks}) (kv_cache.num_blocks)"
                )
            if batch.max_seq_len > width * lim.block_size:
                need = -(-batch.seq_lens // lim.block_size)
                i = int(np.argmax(need > width))
                raise BatchError(
                    f"request {i} has seq_len {int(batch.seq_lens[i])}, which needs {int(need[i])} "
                    f"blocks of {lim.block_size}, but block_table has {width} columns"
                )
        if batch.extras or self.extras:
            self._check_extras_fit(batch)

    def _check_extras_fit(self, batch: StepBatch) -> None:
        declared = {spec.name: spec for spec in self.extras}
        for name, value in batch.extras.items():
            spec = declared.get(name)
            if spec is None:
                known = ", ".join(declared) or "none"
                raise BatchError(f"extras[{name!r}]: no such buffer; declared buffers: {known} (BufferSpec)")
            real = {"tokens": batch.num_tokens, "reqs": batch.num_reqs, "none": None}[spec.rows]
            expected = _real_shape(spec, real)
            if value.shape != expected:
                raise BatchError(
                    f"extras[{name!r}] has shape {tuple(value.shape)}; expected {expected} "
                    f"({spec.rows} rows{'' if real is None else f' = {real}'}, shape {spec.shape}, "
                    f"row_dim {spec.row_dim})"
                )
            _check_extra_values(spec, value)

    # -- views and upload ------------------------------------------------------------------

    def _views_for(self, key: GraphKey) -> tuple:
        """(built-in tensors in ForwardInputs order, HostView, extras, upload end) for `key`, cached."""
        cached = self._views.get((key.num_tokens, key.num_reqs))
        if cached is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.pop(next(iter(self._views)))
            T, R = key.num_tokens, key.num_reqs
            tensors, host, end = {}, {}, 0
            for name, shape, dtype in self._layout:
                spec = next((s for s in self.extras if s.name == name), None)
                index = (
                    _rows(spec, 0, T if spec.rows == "tokens" else R) if spec is not None else _builtin_rows(name, T, R)
                )
                host[name] = self.host[name][index]
                tensors[name] = self._device_view(name, shape, dtype)[index]
                end = max(end, _end_byte(self._offsets[name], host[name]))
            order = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")
            extras = MappingProxyType({s.name: tensors[s.name] for s in self.extras})
            host_extras = MappingProxyType({s.name: host[s.name] for s in self.extras})
            cached = (
                tuple(tensors[n] for n in order),
                HostView(*(host[n] for n in order), host_extras),
                extras,
                end,
            )
            self._views[(key.num_tokens, key.num_reqs)] = cached
        return cached

    def _device_view(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        start = self._offsets[name]
        torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        raw = self._device_tensor[start : start + int(np.prod(shape)) * dtype.itemsize]
        return raw.view(torch_dtype).view(shape)

    def _upload(self, end: int) -> None:
        # One copy covers every staged row of the key: the block table is last in the layout.
        # A host -> device copy runs on the current stream of the *target* device, which need
        # not be the current device (cuda:1 while cuda:0 is current): the event that guards
        # the pinned staging must be recorded on that stream, or stage() overwrites rows the
        # copy still reads (W2).
        self._device_tensor[:end].copy_(self._host_tensor[:end], non_blocking=True)
        if self._copy_done is None:
            with torch.cuda.device(self.device):
                self._copy_done = torch.cuda.Event()
        self._copy_done.record(torch.cuda.current_stream(self.device))

    def storage(self) -> dict[str, torch.Tensor]:
        """The persistent device storage (the whole packed buffer) by name."""
        return {"packed": self._device_tensor}

    @property
    def packed_host(self) -> np.ndarray:
        """The packed host staging buffer as bytes (snapshots in tests and fault checks)."""
        return self._packed

    @property
    def nbytes(self) -> int:
        """Bytes of the packed metadata (each of host and device on CUDA)."""
        return self._packed.nbytes


def _check_extras(extras: tuple[BufferSpec, ...]) -> None:
    names = set()
    for spec in extras:
        if not isinstance(spec, BufferSpec):
            raise TypeError(f"buffers must be graphcap.BufferSpec; got {type(spec).__name__}")
        if spec.name in names:
            raise ValueError(f"buffer {spec.name!r} is declared twice; give each BufferSpec its own name")
        names.add(spec.name)


def _full_shape(spec: BufferSpec, T: int, R: int) -> tuple[int, ...]:
    return _real_shape(spec, T if spec.rows == "tokens" else R)


def _real_shape(spec: BufferSpec, rows: int | None) -> tuple[int, ...]:
    if spec.rows == "none":
        return spec.shape
    shape = list(spec.shape)
    shape.insert(spec.row_dim, rows)
    return tuple(shape)


def _rows(spec: BufferSpec, lo: int, hi: int) -> tuple:
    """Index of rows `[lo, hi)` along the spec's row axis."""
    return (slice(None),) * spec.row_dim + (slice(lo, hi),)


def _builtin_rows(name: str, T: int, R: int) -> slice:
    return slice(0, {"tokens": T, "reqs": R, "reqs+1": R + 1}[_ROWS[name]])


_ROWS = {f.name: f.rows for f in FIELD_TABLE}


def _end_byte(offset: int, view: np.ndarray) -> int:
    """One past the last byte of `view`, a prefix of rows of the field stored at `offset`."""
    if view.size == 0:
        return offset
    return offset + sum((d - 1) * s for d, s in zip(view.shape, view.strides)) + view.itemsize


def _check_extra_values(spec: BufferSpec, value: np.ndarray) -> None:
    dtype = spec.np_dtype
    if value.size == 0:
        return
    if dtype.kind == "b":
        if value.dtype.kind != "b":
            raise BatchError(f"extras[{spec.name!r}] must hold booleans; got dtype {value.dtype}")
        return
    if value.dtype.kind not in "iub" + ("f" if dtype.kind == "f" else ""):
        want = "numbers" if dtype.kind == "f" else "integers"
        raise BatchError(f"extras[{spec.name!r}] must hold {want} for dtype {spec.dtype}; got dtype {value.dtype}")
    if dtype.kind == "f":
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            index = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
            raise BatchError(f"extras[{spec.name!r}]{list(index)} is {value[index]}; values must be finite")
        return
    info = np.iinfo(dtype)
    low, high = int(value.min()), int(value.max())
    if low < info.min or high > info.max:
        bad = value < info.min if low < info.min else value > info.max
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise BatchError(
            f"extras[{spec.name!r}]{list(index)} is {int(value[index])}, outside the range of {spec.dtype} "
            f"[{info.min}, {info.max}]"
        )
