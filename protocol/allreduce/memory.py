"""Give freed heap memory back to the operating system between rounds.

A round allocates and frees many chunk-sized buffers (a few MB) on several threads (the event loop,
the compute thread, gRPC's threads). glibc keeps such freed memory in per-thread arenas instead of
returning it, so a process's resident size ratchets up over rounds although nothing is alive; we
measured ~100 MB of such retention per peer for 25M-number rounds. `malloc_trim(0)` returns it. On a
libc without malloc_trim (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)


def _load_malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_free_memory() -> bool:
    """Return free heap pages to the OS; True if the libc supports it."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
