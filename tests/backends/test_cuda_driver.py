"""The CUDA driver API version in a report: read with `cuDriverGetVersion` from libcuda.so.1 (torch has no
binding for it), or None with the reason; the driver library is simulated where the machine has none."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from graphcap.backends.cuda_driver import cuda_driver_api
from graphcap.report import environment


def _driver(version: int, status: int = 0):
    def cu_driver_get_version(ref) -> int:
        ref._obj.value = version  # what the driver writes through the int* it is given
        return status

    return lambda name: SimpleNamespace(cuDriverGetVersion=cu_driver_get_version)


def test_the_driver_api_version_is_what_cu_driver_get_version_writes():
    assert cuda_driver_api(_driver(13000)) == (13000, None)


def test_without_a_loadable_driver_the_version_is_none_with_the_reason():
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    value, reason = cuda_driver_api(missing)
    assert value is None and reason.startswith("libcuda.so.1 could not be loaded (libcuda.so.1: cannot open")
    assert cuda_driver_api(_driver(0, status=3)) == (None, "cuDriverGetVersion returned CUresult 3")
    assert cuda_driver_api(lambda name: SimpleNamespace()) == (None, "libcuda.so.1 has no cuDriverGetVersion")


@pytest.mark.parametrize("loadable", [True, False])
def test_a_cuda_report_names_the_driver_api_or_why_it_has_none(monkeypatch, loadable):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")

    def load(name):
        if not loadable:
            raise OSError(f"{name}: cannot open shared object file")
        return _driver(12080)(name)

    monkeypatch.setattr(ctypes, "CDLL", load)
    env = environment("cuda")
    if loadable:
        assert env["cuda_driver_api"] == 12080 and "cuda_driver_api_missing" not in env
    else:
        assert env["cuda_driver_api"] is None and "libcuda.so.1 could not be loaded" in env["cuda_driver_api_missing"]
