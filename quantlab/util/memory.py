"""Process memory helpers shared by the rooms that measure or save memory."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_heap() -> None:
    """Return freed heap pages to the OS (glibc malloc_trim; a no-op elsewhere). glibc keeps freed chunks of its
    heap mapped, so without it a process that frees and reallocates many megabyte-sized tensors (a block walk)
    holds RSS it no longer uses."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
