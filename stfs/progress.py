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


def shown(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """Whether a progress bar goes on ``stream`` (stderr): only a terminal's, and not with ``--quiet``."""
    return not quiet and (stream or sys.stderr).isatty()


class ByteProgress:
    """A bar of bytes read of ``total`` on stderr (tqdm: count, rate, time left) while ``enabled``; else nothing,
    and tqdm is not even imported."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self._bar = None
        if enabled and total > 0:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=label,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,  # the bar is gone once done: what stays on the terminal is the report
                dynamic_ncols=True,
            )

    def update(self, count: int) -> None:
        if self._bar is not None:
            self._bar.update(count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
