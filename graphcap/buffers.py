"""`PersistentBuffers`: the static inputs every graph reads, and the one path that fills them.

Dummy runs (capture) and real steps both go through `PersistentBuffers.stage` (the passes
live in `_staging.py`, `_plans.py` and `_padding.py`), so there is no second place to forget
a padded tail. The buffers are allocated once at the maxima and never reallocated: a
captured graph keeps reading the addresses it was captured with. The staged `block_table`
rows double as the persistent block table (`BlockTable`) of engines that keep one.

Layout: every field of `inputs.FIELD_TABLE` and every engine buffer (`BufferSpec`) lives in
one packed byte buffer, each at a 64-byte aligned offset, so with CUDA the host staging is
one pinned array and the upload of a step is one copy of a prefix. On CPU the tensors *are*
the host arrays (zero copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType

import numpy as np
import torch

from graphcap._extras import check_extras, full_shape, pad_extra, rows
from graphcap._staging import Staging
from graphcap.batch import GraphKey
from graphcap.block_table import BlockTable
from graphcap.config import PAD_SLOT_ID, PadRules
from graphcap.inputs import FIELD_TABLE, BufferSpec, ForwardInputs, HostView, StagingLimits

__all__ = ["PAD_SLOT_ID", "POISON", "BufferSpec", "ForwardInputs", "HostView", "PadRules", "PersistentBuffers"]

POISON = np.int32(-0x41414142)
"""What poisoned int32 rows hold before each staging (`checks.poison_padding`): any padded row
the pad rules forgot stays at it, an absurd value that invariants and kernels trip over."""
_ALIGN = 64
_MAX_CACHED_VIEWS = 1024


class PersistentBuffers(Staging):
    """Static input buffers allocated once at the maxima; `stage()` fills them for a step.

    Normally `CaptureManager` owns one and calls `stage` for every step and dummy batch.
    Does not decide keys (the manager's registry does) and does not run the model. Not
    thread-safe: one staging at a time (the manager holds a lock around stage + replay).
    `block_table` is the persistent block table (`BlockTable`) whose rows are the staged
    `block_table` buffer: steps that name it skip copying and scanning a table each step.
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
        check_extras(extras)
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
        layout[-1:-1] = [(s.name, full_shape(s, T, R), s.np_dtype) for s in extras]
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
        self._copy_done = None  # CUDA event of the last upload; host writes wait for it
        self._upload_pending = False
        self._pending_upload: tuple[torch.Tensor, torch.Tensor] | None = None  # staged, not yet uploaded
        self._layout = layout
        # Full-size host views by name (numpy), and the same on the device (torch).
        self.host: Mapping[str, np.ndarray] = MappingProxyType(
            {name: self._host_array(name, shape, dtype) for name, shape, dtype in layout}
        )
        h = self.host
        self._h_qsl, self._h_seq, self._h_bt = h["query_start_loc"], h["seq_lens"], h["block_table"]
        self._h_ids, self._h_pos, self._h_slot = h["input_ids"], h["positions"], h["slot_mapping"]
        self._h_bt_flat = self._h_bt.reshape(-1)
        start = self._offsets["block_table"]
        self._bt_bytes = (start, start + self._h_bt.nbytes)
        self.block_table = BlockTable(
            self._h_bt,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            pad_block=pad.block_id,
            before_write=self._before_table_write,
        )
        self._views: dict[tuple[int, int], tuple] = {}
        self._init_plans()
        self._init_padding()
        for spec in extras:
            pad_extra(self.host[spec.name], spec, T, R, 0, 0)
        # The device copy starts as the padded host staging (every later upload is a prefix).
        self._device_tensor = host.to(self.device) if on_cuda else host

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

    # -- the persistent block table --------------------------------------------------------

    def _before_table_write(self) -> None:
        """Called by `block_table` before it writes a row: the rows must be ours to write."""
        if self._upload_pending:
            self._wait_upload()
        self._claim_table_rows()

    @contextmanager
    def table_set_aside(self) -> Iterator[None]:
        """Keep the persistent block table's rows out of the way of steps that bring their own table.

        Inside, the table is empty (dummy batches of a capture pass can stage fresh tables);
        on exit every row holds its blocks again. O(rows held) copies each way.
        """
        table = self.block_table
        top = table.top
        if not top:
            yield
            return
        saved = table._snapshot()
        table.reset()
        try:
            yield
        finally:
            if self._upload_pending:
                self._wait_upload()
            self._claim_table_rows()
            table._restore(saved)

    # -- poison ----------------------------------------------------------------------------

    def _poison(self, keep_table: bool) -> None:
        """Fill every byte with 0xBE (int rows read POISON), floats with NaN, bools with True.

        `keep_table`: the persistent block table's rows stay (steps do not write them).
        """
        if keep_table:
            start, stop = self._bt_bytes
            self._packed[:start].fill(0xBE)
            self._packed[stop:].fill(0xBE)
        else:
            self._packed.fill(0xBE)
        for name, _, dtype in self._layout:
            if dtype.kind == "f":
                self.host[name].fill(np.nan)
            elif dtype.kind == "b":
                self.host[name].fill(True)
        self._poisoned(keep_table)

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
                    rows(spec, 0, T if spec.rows == "tokens" else R) if spec is not None else _builtin_rows(name, T, R)
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

    def upload(self, key: GraphKey | None = None) -> None:
        """Copy the last staged rows (of `key`, if given) to the device: one copy; nothing on CPU.

        For `stage(..., upload=False)`: the manager stages, lets the model's `prepare` plan,
        checks the invariants on the host rows, then uploads them.
        """
        rows = self._upload_rows(self._views_for(key)[3]) if key is not None else self._pending_upload
        self._pending_upload = None
        if rows is not None:
            self._upload(rows)

    def _upload_or_defer(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Upload now, or keep `rows` for `upload()` when the stage asked for `upload=False`."""
        if self._upload_now:
            self._upload(rows)
        else:
            self._pending_upload = rows

    def _upload(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy `rows` = (device prefix, pinned host prefix) asynchronously (`_upload_rows(end)` makes them)."""
        # One copy covers every staged row of the key: the block table is last in the layout.
        # A host -> device copy runs on the current stream of the *target* device, which need
        # not be the current device (cuda:1 while cuda:0 is current): the event that guards
        # the pinned staging must be recorded on that stream, or stage() overwrites rows the
        # copy still reads (W2).
        rows[0].copy_(rows[1], non_blocking=True)
        if self._copy_done is None:
            with torch.cuda.device(self.device):
                self._copy_done = torch.cuda.Event()
        self._copy_done.record(torch.cuda.current_stream(self.device))
        self._upload_pending = True

    def _upload_rows(self, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (device, host) prefixes one upload of `end` bytes copies; None on the CPU (zero copy)."""
        if self._device_tensor is self._host_tensor:
            return None
        return self._device_tensor[:end], self._host_tensor[:end]  # sliced once: ~1 us each per step

    def _wait_upload(self) -> None:
        """Wait until the last upload has read the pinned host staging (host writes come next)."""
        self._copy_done.synchronize()
        self._upload_pending = False

    def upload_nbytes(self, key: GraphKey) -> int:
        """Bytes one step of `key` uploads on CUDA: the packed prefix that holds every row of the key."""
        return self._views_for(key)[3]

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


def _builtin_rows(name: str, T: int, R: int) -> slice:
    return slice(0, {"tokens": T, "reqs": R, "reqs+1": R + 1}[_ROWS[name]])


_ROWS = {f.name: f.rows for f in FIELD_TABLE}


def _end_byte(offset: int, view: np.ndarray) -> int:
    """One past the last byte of `view`, a prefix of rows of the field stored at `offset`."""
    if view.size == 0:
        return offset
    return offset + sum((d - 1) * s for d, s in zip(view.shape, view.strides)) + view.itemsize
