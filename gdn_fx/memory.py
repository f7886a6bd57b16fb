"""Memory handed back to the kernel after a large load (tract's loading, a checkpoint's
streaming)."""

from __future__ import annotations


def release_freed_memory() -> None:
    """Hand the memory that loading freed back to the kernel (glibc's ``malloc_trim``).

    tract reads each weight through buffers it frees once the tensor is built, and
    ``into_runnable`` replaces weights by packed copies; glibc keeps those freed blocks in the
    heap (its mmap threshold grows with the first large frees), so the process stays ~1.3-1.5x
    the artifact's bytes after a load, trimmed ~1.04x (bench/bench_load.py, docs/FACTS.md).
    Nothing where the C library has no ``malloc_trim`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
