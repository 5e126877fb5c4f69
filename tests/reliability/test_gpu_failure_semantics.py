"""Capture failures as a GPU has them, on the CPU: a failed key's tensors are freed before the next
key runs, a sticky CUDA error stops the pass with one message, an OOM CUDA reports as a plain
CUDA error keeps the memory hint, and a backend that needs warmups refuses zero."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from graphcap import CaptureError, CaptureManager, ConfigError, GraphKey, load_config
from graphcap.backends import EmulatedBackend, is_sticky_cuda_error
from graphcap.phases import phase
from graphcap.testing import FAULT_SIZES, assert_nothing_left, make_config, make_manager

LARGEST = GraphKey(4, 4, True)  # the first key a FAULT_SIZES pass captures
ASSERT = "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported"


class LeakyForward(torch.nn.Module):
    """The reference model; the largest key's capture makes a tensor, tracks it, then fails."""

    def __init__(self, inner: torch.nn.Module, make_exc) -> None:
        super().__init__()
        self.inner, self.make_exc = inner, make_exc
        self.refs: list[weakref.ref] = []
        self.alive_at: dict[GraphKey, list[bool]] = {}

    def forward(self, inputs):
        self.alive_at.setdefault(inputs.key, [r() is not None for r in self.refs])
        if inputs.key == LARGEST and phase() == "capture":  # the recording, after its warmup
            scratch = torch.ones(1 << 16)  # on a GPU: a block of the graph pool
            self.refs.append(weakref.ref(scratch))
            raise self.make_exc()
        return self.inner(inputs)


def _leaky_manager(on_error: str, make_exc) -> CaptureManager:
    config = make_config(FAULT_SIZES, capture__on_error=on_error)
    inner = make_manager(config).model
    return CaptureManager(LeakyForward(inner, make_exc), config, backend="emulated", progress=False)


def test_a_failed_keys_tensors_are_freed_before_the_next_key_runs():
    manager = _leaky_manager("skip", lambda: torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    report = manager.capture()  # GC stays off for the whole pass: only refcounting frees them
    assert [r.key for r in report.skipped] == [LARGEST] and len(report.captured) == 3
    later = [key for key in manager.registry.capture_order() if key != LARGEST]
    assert all(manager.model.alive_at[key] == [False] for key in later)


def test_a_failed_pass_does_not_pin_the_failed_forward_through_the_error_the_caller_holds():
    manager = _leaky_manager("raise", lambda: RuntimeError("model bug"))
    with pytest.raises(
        CaptureError, match=r"capturing uniform\(tokens=4, reqs=4\) failed: RuntimeError: model bug"
    ) as info:
        manager.capture()
    assert manager.model.refs[0]() is None  # an engine that logs or keeps the error keeps no GPU memory
    assert "forward" in "".join(__import__("traceback").format_tb(info.value.__cause__.__traceback__))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_sticky_cuda_error_stops_the_pass_with_one_clear_message(on_error):
    manager = _leaky_manager(on_error, lambda: torch.AcceleratorError(ASSERT))
    frozen = gc.get_freeze_count()
    with pytest.raises(CaptureError) as info:
        manager.capture()
    message = str(info.value)
    assert message.startswith("capturing uniform(tokens=4, reqs=4) failed: AcceleratorError: CUDA error: device-side")
    for hint in ("sticky", "restart the process", "CUDA_LAUNCH_BLOCKING=1", "checks.invariants: full"):
        assert hint in message
    assert list(manager.model.alive_at) == [LARGEST]  # no later key was tried (and blamed)
    assert_nothing_left(manager, frozen_before=frozen)


def test_sticky_cuda_errors_are_told_from_recoverable_ones():
    assert is_sticky_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_sticky_cuda_error(torch.AcceleratorError(ASSERT))
    assert not is_sticky_cuda_error(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert not is_sticky_cuda_error(RuntimeError("device-side assert triggered"))  # not a CUDA error


CUBLAS_FAILED = "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`"


@pytest.mark.parametrize("poisoned", [True, False])
def test_a_sticky_error_cublas_reports_first_is_told_from_a_failure_of_its_own(monkeypatch, poisoned):
    def synchronize(device=None) -> None:
        if poisoned:  # the context holds the sticky error: every CUDA call returns it
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    assert is_sticky_cuda_error(torch.AcceleratorError(CUBLAS_FAILED)) is poisoned
    internal = CUBLAS_FAILED.replace("EXECUTION_FAILED", "INTERNAL_ERROR")
    assert is_sticky_cuda_error(RuntimeError(internal)) is poisoned
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLt`"))


def test_a_sticky_error_cublas_reports_first_stops_the_pass(monkeypatch):
    def synchronize(device=None) -> None:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    manager = _leaky_manager("skip", lambda: torch.AcceleratorError(CUBLAS_FAILED))
    with pytest.raises(CaptureError, match=r"failed: AcceleratorError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED"):
        manager.capture()
    assert list(manager.model.alive_at) == [LARGEST]  # under on_error: skip too, no later key was tried


def test_an_out_of_memory_cuda_error_gets_the_memory_hint():
    # cudaGraphInstantiate runs out of memory as "CUDA error: out of memory", not OutOfMemoryError.
    manager = _leaky_manager("skip", lambda: torch.AcceleratorError("CUDA error: out of memory"))
    (skipped,) = manager.capture().skipped
    assert skipped.reason.startswith("out of memory (CUDA error: out of memory); ")
    assert "capture.on_error: skip" in skipped.reason


class NeedsWarmups(EmulatedBackend):
    """The emulated backend with the CUDA backend's rule: one plain warmup before capture."""

    min_warmups = 1


def test_num_warmups_zero_is_refused_for_a_backend_that_needs_warmups():
    config = make_config(FAULT_SIZES, capture__num_warmups=0)
    manager = make_manager(config, backend=NeedsWarmups("cpu"))
    with pytest.raises(ConfigError, match=r"capture\.num_warmups: 0 is too few for the emulated backend"):
        manager.capture()
    with pytest.raises(ValueError, match=r"0 is too few for the emulated backend: it needs at least 1 plain warmup"):
        manager.backend.warmup(lambda: torch.ones(1), 0)
    make_manager(config).capture()  # the emulated backend itself accepts 0


def test_num_warmups_zero_with_a_cuda_device_is_a_config_problem():
    with pytest.raises(ConfigError, match=r"capture\.num_warmups: 0 with device cuda:0: the cuda backend needs"):
        load_config(overrides={"device": "cuda:0", "capture.num_warmups": 0})
    load_config(overrides={"device": "cuda:0", "capture.num_warmups": 0, "capture.mode": "none"})
