"""Keeps freed host memory for reuse instead of handing it back to the OS on every free.

PyTorch's CPU allocator is plain malloc. glibc serves large blocks with fresh mmaps and trims
the heap top once a little of it is free, so a forward that allocates and frees the same tens
of megabytes every layer page-faults (and zeroes) all of them again each time. CUDA has a
caching allocator for this; on the host we get the same effect from two glibc settings: serve
blocks up to MMAP_THRESHOLD_BYTES from the heap and never trim it below TRIM_THRESHOLD_BYTES
of free space. Measured on the 2-core CPU over 20 decode steps of 64 sequences (Qwen2.5-0.5B
shapes): 250k page faults down to 50-60k, system time halved, the steps ~10% faster.

The cost is that the process keeps its peak heap (as a caching allocator does). It is process-
wide, so it is applied once when a model is loaded on the CPU, and VACPACK_HOST_MALLOC=0 turns
it off. On a libc without mallopt (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# mallopt takes a C int: both stay below 2 GiB. Larger blocks still come from mmap, and so do
# blocks over 64 MiB allocated by threads other than the main one (glibc's arena heap size).
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Applies the settings once per process; True when they are in effect."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def load_libc() -> ctypes.CDLL | None:
    """The C library, or None where there is none to load."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _apply() -> bool:
    if os.environ.get("VACPACK_HOST_MALLOC", "1") == "0":
        return False
    libc = load_libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not applied:
        logger.info("mallopt refused the host allocator settings; keeping the defaults")
    return applied
