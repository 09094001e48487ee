"""The name the kernel shows for a thread of the daemon (``top -H``, ``perf report --sort comm``,
/proc/PID/task/TID/comm): Python names its threads for itself only."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

PR_SET_NAME = 15  # linux/prctl.h
NAME_MAX = 15  # the kernel keeps 16 bytes, the last a NUL


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (cut to 15 bytes) where the kernel shows it; nothing where it cannot."""
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_SET_NAME, name.encode()[:NAME_MAX], 0, 0, 0)
