"""A progress line on a terminal while reading headers takes more than a second (many shards, a slow server)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

DELAY = 1.0


class Progress:
    """Counts shards read; shows ``stfs: reading headers: 37/100`` on ``stream`` if it is a terminal and
    reading has taken longer than a second. Silent otherwise (a pipe, a log, a test)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = 0
        self.done = 0
        self.started = time.monotonic()
        self.shown = False
        self._lock = threading.Lock()

    def start(self, total: int) -> None:
        with self._lock:
            self.total += total

    def step(self) -> None:
        with self._lock:
            self.done += 1
            if self.enabled and time.monotonic() - self.started >= DELAY:
                self.stream.write(f"\rstfs: reading headers: {self.done}/{self.total}")
                self.stream.flush()
                self.shown = True

    def finish(self) -> None:
        """Clear the line, if one was shown."""
        with self._lock:
            if self.shown:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self.shown = False
