"""Giving the heap's free memory back to the system.

glibc keeps memory that was freed in its arenas (one per thread that allocates, and a worker
runs dozens of threads: torch's, gloo's, Ray's), so a long-running training process grows
though nothing leaks: measured on the soak's actor rank, 612 MiB fell to 495 MiB after one
``malloc_trim(0)``. :func:`trim_heap` hands it back; it costs ~10-50 ms, once per update.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to trim
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """``malloc_trim(0)`` where the C library has it; whether it ran."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
