"""The CUDA driver's memory pool, as tract's CUDA runtime uses it.

tract allocates every intermediate tensor of a call with stream-ordered allocations
(cudarc's ``cuMemAllocAsync``) from the device's default memory pool, and frees them the same
way. That pool's release threshold is 0 by default: at every synchronization (each call ends
with one, when its outputs come back to the host) the driver hands the freed memory back to
the OS, so the next call maps it again. ``keep_freed_memory`` raises the threshold so that
freed memory stays in the pool for the next call (the process holds its high-water mark of
intermediates; tract frees them to the pool at the end of each call).

Plain ctypes on libcuda: no CUDA toolkit or Python package needed, nothing done where there
is no driver.
"""

from __future__ import annotations

import ctypes
from typing import Optional

RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (cuda.h, CUmemPool_attribute)
KEEP_ALL = 2 ** 64 - 1


def _driver() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def set_release_threshold(threshold: int, device: int = 0) -> Optional[str]:
    """Set the default pool's release threshold of ``device`` (bytes kept in the pool across
    synchronizations). None when done, else why not (no driver, a driver error)."""
    cuda = _driver()
    if cuda is None:
        return "no CUDA driver (libcuda.so.1) here"
    handle, pool = ctypes.c_int(), ctypes.c_void_p()
    value = ctypes.c_uint64(threshold)
    for name, call in (("cuInit", lambda: cuda.cuInit(0)),
                       ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(handle), device)),
                       ("cuDeviceGetDefaultMemPool",
                        lambda: cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), handle)),
                       ("cuMemPoolSetAttribute",
                        lambda: cuda.cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD,
                                                           ctypes.byref(value)))):
        status = call()
        if status != 0:
            return f"{name} failed with CUDA error {status}"
    return None


def keep_freed_memory(device: int = 0) -> Optional[str]:
    """Keep every freed byte in the pool (the threshold at its maximum): see the module."""
    return set_release_threshold(KEEP_ALL, device)
