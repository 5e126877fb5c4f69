"""The preflight names a random op drawing from a CUDA generator that capture would not know, on fake CUDA
tensors (no GPU needed), and is quiet for the default generator and for generators given to graphcap.
tests/backends/test_cuda.py shows on a GPU what an unregistered generator does to a capture, and that a
registered one replays fresh random numbers."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphcap.backends import CaptureUnsafeError, check_capture_safe
from graphcap.backends.preflight import preflight
from tests.backends.conftest import marked_line
from tests.backends.test_cuda_capture_simulated import CUDAGenerator

DRAWS = {
    "Tensor.normal_": lambda x, g: x.normal_(generator=g),  # unsafe
    "torch.multinomial": lambda x, g: torch.multinomial(x.abs() + 1, 1, generator=g),  # unsafe
    "torch.randn": lambda x, g: torch.randn(4, device="cuda", generator=g),  # unsafe
    "torch.bernoulli": lambda x, g: torch.bernoulli(x.sigmoid(), generator=g),  # unsafe
}


@pytest.mark.parametrize("op", sorted(DRAWS))
def test_a_draw_from_an_unregistered_cuda_generator_is_named_with_its_line_and_the_fix(op):
    sampler = CUDAGenerator()
    draw = DRAWS[op]
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 8, device="cuda")
        with pytest.raises(CaptureUnsafeError) as caught:
            check_capture_safe(lambda: draw(x, sampler), "cuda")
    error = caught.value
    assert error.op == op and error.location == marked_line(draw)
    assert "neither the device's default generator nor registered" in error.reason
    assert "CaptureManager(..., generators=[g])" in error.fix


def test_generators_given_to_graphcap_and_the_default_one_are_not_named():
    sampler = CUDAGenerator()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 8, device="cuda")
        for draw in DRAWS.values():
            check_capture_safe(lambda draw=draw: draw(x, sampler), "cuda", generators=[sampler])
        check_capture_safe(lambda: x.normal_(), "cuda")  # the default generator: torch registers it
        with preflight("cuda", generators=[sampler]):  # what the backend's warmup runs
            x.normal_(generator=sampler)
        with pytest.raises(CaptureUnsafeError, match=r"Tensor\.normal_ at "), preflight("cuda"):
            x.normal_(generator=sampler)


def test_only_a_cuda_graph_needs_generators_registered():
    x = torch.empty(4, 8)
    check_capture_safe(lambda: x.normal_(generator=torch.Generator()), "cpu")


def test_check_capture_safe_refuses_generators_of_another_device_naming_the_argument():
    with pytest.raises(ValueError, match=r"check_capture_safe\(generators=...\)\[0\] is a generator of cpu"):
        check_capture_safe(lambda: None, "cuda", generators=[torch.Generator()])
