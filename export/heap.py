"""Hand memory a finished phase no longer uses back to the operating system.

Python frees objects into its own allocator and glibc's, which keep the pages: after a phase
that made many small objects (a GGUF vocabulary, the trace's graphs) the resident set stays at
its high-water mark, and the next phase's memory stacks on top of it. `release()` collects
reference cycles and asks glibc to return free heap pages (`malloc_trim`); elsewhere (macOS,
musl) only the collection runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache


@cache
def _trim():  # noqa: ANN202 - a ctypes function, or None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release() -> None:
    """Collect garbage, then return free heap pages to the OS where the C library can."""
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
