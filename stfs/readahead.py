"""The kernel's readahead for the files of a mount: the size of the read requests FUSE sends the daemon.

The kernel starts a FUSE mount at 128 KiB; stfs raises it once the mount answers (root only:
``/sys/class/bdi/DEV/read_ahead_kb``) so that reads arrive as requests of ``max_read``. A file takes the value
the mount has when it is opened (``do_dentry_open`` runs ``file_ra_state_init`` after the daemon answered
OPEN), so writing the mount's value before answering an OPEN gives that file a readahead of its own.

On a remote mount stfs gives one a smaller window: a safetensors file of ``files/``, which a loader maps
(``safe_open``) and jumps into. Each fault of that mapping makes the kernel read around it
(``do_sync_mmap_readahead``: half a window before, then windows after), and the header's fault reads a
window too: about 2.5 windows beyond what a jump to one tensor touches, all fetched from the server. A
window of at most 1/32 of the file's typical tensor keeps that within a tenth of the tensor
(``jump_window_kb``); every other file gets the mount's whole window again. The price is a sequential
reader of such a file: its requests are that window's size (docs/benchmarks.md). A local source's
read-around costs no request, and its files keep the whole window.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

SMALLEST_KB = 128  # the kernel's own default: smaller requests only cost more of them
JUMP_SHARE = 32  # a window of at most 1/32 of the tensor a loader jumps to: 2.5 windows are under a tenth of it
PAGE_KB = 4


def jump_window_kb(tensor_sizes: Iterable[int]) -> int:
    """The readahead (KiB) for a safetensors file whose tensors have ``tensor_sizes``: 1/32 of its typical tensor
    (the one holding its median byte, where a jump to a random byte lands), in pages, at least 128 KiB."""
    sizes = sorted(size for size in tensor_sizes if size > 0)
    half, seen = sum(sizes) / 2, 0
    typical = 0
    for size in sizes:
        seen += size
        if seen >= half:
            typical = size
            break
    window = typical // JUMP_SHARE // 1024 // PAGE_KB * PAGE_KB
    return max(SMALLEST_KB, window)


class Readahead:
    """The mount's readahead setting: its default, set once the mount answers (``tune``), and the window of each
    file opened (``opened``). Without root the setting cannot be written: every call then does nothing."""

    def __init__(self) -> None:
        self._fd = -1
        self.default_kb = 0
        self._current_kb = 0
        self._lock = threading.Lock()
        self._native: Any = None

    def answer_in(self, native: Any) -> None:
        """Let stfs._native, which answers OPEN in C, write the setting too (``set_readahead``)."""
        self._native = native

    def tune(self, device: str | None, default_kb: int) -> None:
        """Set the mount ``device`` ("major:minor")'s readahead to ``default_kb`` and keep the setting open."""
        if device is None:
            return
        path = f"/sys/class/bdi/{device}/read_ahead_kb"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("cannot set %s: %s", path, exc)
            return
        try:
            os.write(fd, str(default_kb).encode())
        except OSError as exc:
            os.close(fd)
            log.debug("cannot set %s: %s", path, exc)
            return
        with self._lock:
            self._fd, self.default_kb, self._current_kb = fd, default_kb, default_kb
        if self._native is not None:
            self._native.set_readahead(fd, default_kb)

    def opened(self, window_kb: int) -> None:
        """Before OPEN of a file is answered: give it ``window_kb`` (0: the mount's default)."""
        if self._fd < 0:
            return
        want = min(window_kb, self.default_kb) if window_kb else self.default_kb
        with self._lock:
            if want == self._current_kb:
                return
            self._current_kb = want
            try:
                os.pwrite(self._fd, str(want).encode(), 0)
            except OSError as exc:
                log.debug("cannot set the readahead to %d KiB: %s", want, exc)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
