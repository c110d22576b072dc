"""The executor's resident memory, reported where weights and the KV cache are sized.

Read from /proc (Linux), with the peak from getrusage as the fallback elsewhere, so no
extra dependency: the figure goes into the `model runner ready` log line and into
`kvserve bench executor`, next to the weights and KV budget it should stay close to.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys
from collections.abc import Callable
from pathlib import Path

_STATUS = Path("/proc/self/status")
MIB = 1024 * 1024


def resident_bytes() -> int:
    """Current resident set size (VmRSS); where /proc is missing, the peak so far."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`); a no-op elsewhere.

    Loading parses and converts every weight through transient buffers (Q4_1 codes unpack to
    int32 before packing); once freed, glibc keeps most of them in its arenas, where they still
    count as resident memory though nothing uses them."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """Looked up once: `find_library` runs `ldconfig` (milliseconds), and large steps trim every time."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
