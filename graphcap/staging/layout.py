"""`PackedLayout`: every staged field in one packed byte buffer, its views per key, and the upload.

Every built-in field (`graphcap.fields.FIELD_TABLE`) and every engine buffer (`BufferSpec`)
lives at a 64-byte aligned offset of one byte buffer, the block table last, so one copy of a
prefix uploads every staged row of a key. With CUDA the host side is one pinned array and the
upload is asynchronous (an event guards the pinned rows until the copy has read them); on the
CPU the device tensors *are* the host arrays (zero copy, no upload). A view a forward changed in
place (`resize_`, `set_`) is put back by `restore_views` (each capture does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import torch

from graphcap.torch_modes import no_torch_function

__all__ = ["Entry", "KeyViews", "PackedLayout"]

log = logging.getLogger("graphcap")

_ALIGN = 64
_MAX_CACHED_VIEWS = 1024


class Entry(NamedTuple):
    """One field of the packed buffer."""

    name: str
    shape: tuple[int, ...]
    """The full shape (rows at the maxima)."""
    dtype: np.dtype
    rows: str
    """`tokens`, `reqs`, `reqs+1` or `none` (the whole tensor every step)."""
    row_dim: int = 0
    """The axis the rows run along."""


class KeyViews(NamedTuple):
    """The views of one padded shape `(T, R)`: device tensors and host arrays by name, and the upload end."""

    tensors: Mapping[str, torch.Tensor]
    host: Mapping[str, np.ndarray]
    end: int
    """One past the last byte any of these rows occupies: the prefix an upload copies."""


class PackedLayout:
    """The packed host buffer (pinned on CUDA), its device copy, and the views and upload of a key's rows.

    Does not know what the fields mean: staging writes the host views, `upload` copies them.
    """

    def __init__(self, entries: Sequence[Entry], device: torch.device) -> None:
        self.entries = tuple(entries)
        self.device = device
        self.offsets: dict[str, int] = {}
        total = 0
        for entry in self.entries:
            self.offsets[entry.name] = total
            total += -(-int(np.prod(entry.shape)) * entry.dtype.itemsize // _ALIGN) * _ALIGN
        on_cuda = device.type == "cuda"
        self.host_tensor = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
        self.packed = self.host_tensor.numpy()
        """The packed host staging buffer as bytes."""
        self.host: Mapping[str, np.ndarray] = MappingProxyType(
            {entry.name: self._host_array(entry) for entry in self.entries}
        )
        """Full-size host views (numpy) by name."""
        self.device_tensor = self.host_tensor  # replaced by `start_device` on CUDA
        self.upload_pending = False
        """An upload was issued and may still read the pinned host rows."""
        self._copy_done: torch.cuda.Event | None = None  # CUDA event of the last upload
        self._views: dict[tuple[int, int], KeyViews] = {}
        self._geometry: dict[tuple[int, int], dict[str, tuple]] = {}  # (T, R) -> name -> (offset, size, stride)

    def start_device(self) -> None:
        """Make the device copy: the host staging as it is now (every later upload is a prefix)."""
        if self.device.type == "cuda":
            self.device_tensor = self.host_tensor.to(self.device)

    def span(self, name: str) -> tuple[int, int]:
        """The byte range `[start, stop)` of field `name`."""
        start = self.offsets[name]
        return start, start + self.host[name].nbytes

    def views(self, T: int, R: int) -> KeyViews:
        """The rows of padded shape `(T, R)` of every field, cached (a `none` field: all of it)."""
        cached = self._views.get((T, R))
        if cached is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                oldest = next(iter(self._views))
                del self._views[oldest], self._geometry[oldest]
            counts = {"tokens": T, "reqs": R, "reqs+1": R + 1}
            tensors, host, end, geometry = {}, {}, 0, {}
            for entry in self.entries:
                if entry.rows == "none":
                    index: tuple = (Ellipsis,)
                else:
                    index = (slice(None),) * entry.row_dim + (slice(0, counts[entry.rows]),)
                host[entry.name] = view = self.host[entry.name][index]
                tensors[entry.name] = tensor = self._device_view(entry)[index]
                geometry[entry.name] = (tensor.storage_offset(), tensor.shape, tensor.stride())
                end = max(end, _end_byte(self.offsets[entry.name], view))
            cached = KeyViews(MappingProxyType(tensors), MappingProxyType(host), end)
            self._views[(T, R)] = cached
            self._geometry[(T, R)] = geometry
        return cached

    def restore_views(self, shape: tuple[int, int] | None = None) -> list[str]:
        """Put back the cached device views a forward changed in place; the names of those it put back.

        A forward that ran `resize_`, `set_` or `as_strided_` on a staged tensor left the cached view
        (the one every later step and capture of that shape is handed) with another shape or memory:
        every later capture of the shape would fail on it, the model fixed or not. `shape`: only the
        views of that `(T, R)`; None: all. The same tensor objects are restored, so every
        `ForwardInputs` holding them is right again. Logs a warning naming what it put back.
        """
        storage = self.device_tensor.untyped_storage()
        address = storage.data_ptr()
        shapes = list(self._views) if shape is None else [shape] if shape in self._views else []
        restored = []
        for key in shapes:
            geometry = self._geometry[key]
            for name, tensor in self._views[key].tensors.items():
                offset, size, stride = geometry[name]
                if (
                    tensor.untyped_storage().data_ptr() != address
                    or tensor.storage_offset() != offset
                    or tensor.shape != size
                    or tensor.stride() != stride
                ):
                    with torch.no_grad():
                        tensor.set_(storage, offset, size, stride)
                    restored.append(name)
        if restored:
            log.warning(
                "a forward changed the staged %s in place (resize_, set_ or as_strided_ on ForwardInputs); "
                "graphcap put the views back",
                ", ".join(restored),
            )
        return restored

    # -- upload ----------------------------------------------------------------------------

    def rows_for(self, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (device, host) prefixes one upload of `end` bytes copies; None on the CPU (zero copy)."""
        if self.device_tensor is self.host_tensor:
            return None
        return self.device_tensor[:end], self.host_tensor[:end]  # sliced once per plan, not per step

    def upload(self, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy `rows` (from `rows_for`) to the device asynchronously and record the copy's event."""
        # A host -> device copy runs on the current stream of the *target* device, which need
        # not be the current device (cuda:1 while cuda:0 is current): the event that guards the
        # pinned staging must be recorded on that stream, or the next stage overwrites rows the
        # copy still reads.
        with no_torch_function():  # graphcap's own copy: an engine's torch modes need not see it
            rows[0].copy_(rows[1], non_blocking=True)
            done = self._copy_done
            if done is None:
                with torch.cuda.device(self.device):
                    done = self._copy_done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        self.upload_pending = True

    def wait(self) -> None:
        """Wait until the last upload has read the pinned host staging (host writes come next)."""
        if self._copy_done is not None:  # None: nothing was uploaded yet
            self._copy_done.synchronize()
        self.upload_pending = False

    # -- internals -------------------------------------------------------------------------

    def _host_array(self, entry: Entry) -> np.ndarray:
        start = self.offsets[entry.name]
        size = int(np.prod(entry.shape)) * entry.dtype.itemsize
        return self.packed[start : start + size].view(entry.dtype).reshape(entry.shape)

    def _device_view(self, entry: Entry) -> torch.Tensor:
        start = self.offsets[entry.name]
        torch_dtype = torch.from_numpy(np.empty(0, entry.dtype)).dtype
        raw = self.device_tensor[start : start + int(np.prod(entry.shape)) * entry.dtype.itemsize]
        return raw.view(torch_dtype).view(entry.shape)


def _end_byte(offset: int, view: np.ndarray) -> int:
    """One past the last byte of `view`, a prefix of rows of the field stored at `offset`."""
    if view.size == 0:
        return offset
    return offset + sum((d - 1) * s for d, s in zip(view.shape, view.strides)) + view.itemsize
