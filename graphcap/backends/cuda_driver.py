"""The CUDA driver API version, read from the driver itself (`cuDriverGetVersion` in libcuda.so.1).

torch has no binding for it (`torch._C` has no `_cuda_getDriverVersion` in torch 2.11 or 2.13, and
`torch.version.cuda` is the runtime torch was built with), so a report reads it with ctypes. Loading
libcuda.so.1 does not initialise CUDA, and `cuDriverGetVersion` works before `cuInit`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["cuda_driver_api"]

LIBCUDA = "libcuda.so.1"


def cuda_driver_api(load: Callable[[str], object] | None = None) -> tuple[int | None, str | None]:
    """(the driver's CUDA API version, e.g. 13000 for CUDA 13.0, or None; why it is None, or None).

    `load` opens the shared library (default `ctypes.CDLL`).
    """
    try:
        libcuda = (load or ctypes.CDLL)(LIBCUDA)
    except OSError as exc:
        return None, f"{LIBCUDA} could not be loaded ({exc})"
    get_version = getattr(libcuda, "cuDriverGetVersion", None)
    if get_version is None:
        return None, f"{LIBCUDA} has no cuDriverGetVersion"
    version = ctypes.c_int(0)
    status = get_version(ctypes.byref(version))
    if status != 0:
        return None, f"cuDriverGetVersion returned CUresult {status}"
    return version.value, None
