"""Keep freed host memory in the process, so a step's tensors do not fault their pages in anew.

glibc serves an allocation above its mmap threshold (128 KiB, raised as such blocks are freed, up
to 32 MiB) with a fresh ``mmap`` and returns freed heap above its trim threshold to the system. A
step's activations and attention grids are megabytes each, allocated and freed in every layer, so
their pages were faulted in and zeroed again and again: about a third of a CPU decode step's time
(docs/serving.md). Raising both thresholds once, at a worker's start, keeps those pages in the
process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: larger values are refused
TRIM_THRESHOLD = 1 << 30  # freed heap kept up to this much before any is returned


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False (and nothing changed) where
    the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the mmap/trim thresholds: host memory is returned after every step")
    return ok
