"""On the CPU: the event guarding the pinned staging is recorded on the stream the upload runs
on, the current stream of the buffers' device, even when another device is current. The CUDA
calls are recorded instead of made (a CPU build has no streams)."""

from __future__ import annotations

import contextlib

import torch

from graphcap import GraphKey, StepBatch
from graphcap.staging import PersistentBuffers


class _Event:
    def __init__(self) -> None:
        self.recorded_on: list = []
        self.waits = 0

    def record(self, stream=None) -> None:
        self.recorded_on.append(stream)

    def synchronize(self) -> None:
        self.waits += 1


def test_the_upload_event_is_recorded_on_the_target_devices_stream(monkeypatch):
    buffers = PersistentBuffers(4, 8, 2, "cpu")
    layout = buffers.layout
    layout.device = torch.device("cuda", 1)  # the manager's device; cuda:0 is the current one
    layout.device_tensor = torch.zeros_like(layout.host_tensor)  # a separate "device" copy
    events: list[_Event] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: events.append(_Event()) or events[-1])
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    batch = StepBatch([1, 1], [3, 5], [7, 9])
    buffers.stage(batch, GraphKey(2, 2, True))
    buffers.stage(batch, GraphKey(2, 2, True))
    (event,) = events
    assert event.recorded_on == ["stream of cuda:1", "stream of cuda:1"]
    assert event.waits == 1  # the second staging waited for the first upload before writing
    assert torch.equal(layout.device_tensor, layout.host_tensor)  # and the copy happened
