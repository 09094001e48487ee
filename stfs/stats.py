"""Request counters for benchmarks and diagnosis, off unless ``STFS_STATS`` is set.

``STFS_STATS=PATH stfs mount ...`` makes the daemon count every FUSE call it
serves and the size of every read request, and write them as JSON to PATH
when it is unmounted and whenever it receives SIGUSR1::

    {"pid": 1234, "dumps": 2, "calls": {"read": 512, "getattr": 3, ...},
     "reads": 512, "read_bytes": 536870912, "read_sizes": {"1048576": 512}}

``read_sizes`` maps the size the kernel asked for to how many requests asked
for it. Without the variable nothing is counted.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

ENVIRONMENT_VARIABLE = "STFS_STATS"


class Stats:
    """Counters of one daemon; every method is safe to call from libfuse's worker threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._local = threading.local()
        self._counters: list[_Counters] = []  # one per thread that counted: no lock on the hot path
        self._dumps = 0
        self._more: list[Callable[[], tuple[dict[str, int], dict[int, int], int]]] = []

    def _mine(self) -> _Counters:
        counters: _Counters | None = getattr(self._local, "counters", None)
        if counters is None:
            counters = self._local.counters = _Counters()
            with self._lock:
                self._counters.append(counters)
        return counters

    def also_count(self, counts: Callable[[], tuple[dict[str, int], dict[int, int], int]]) -> None:
        """Add what ``counts()`` returns (calls, read sizes, bytes read: stfs._native's) to every snapshot."""
        self._more.append(counts)

    def count_call(self, name: str) -> None:
        self._mine().calls[name] += 1

    def count_read(self, requested: int, served: int) -> None:
        counters = self._mine()
        counters.read_sizes[requested] += 1
        counters.read_bytes += served

    def snapshot(self) -> dict[str, object]:
        calls: Counter[str] = Counter()
        sizes: Counter[int] = Counter()
        read_bytes = 0
        with self._lock:
            for counters in self._counters:  # a thread may count while this adds up: a figure or two late
                calls.update(counters.calls.copy())
                sizes.update(counters.read_sizes.copy())
                read_bytes += counters.read_bytes
            dumps = self._dumps
        for more in self._more:
            more_calls, more_sizes, more_bytes = more()
            calls.update(more_calls)
            sizes.update(more_sizes)
            read_bytes += more_bytes
        return {
            "pid": os.getpid(),
            "dumps": dumps,
            "calls": dict(calls),
            "reads": sum(sizes.values()),
            "read_bytes": read_bytes,
            "read_sizes": {str(size): count for size, count in sorted(sizes.items())},
        }

    def dump(self) -> None:
        """Write the counters to ``path`` atomically (a reader never sees half a file)."""
        with self._lock:
            self._dumps += 1
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as stream:
            json.dump(self.snapshot(), stream)
        os.replace(temporary, self.path)

    def dump_on_sigusr1(self) -> None:
        """Dump on every SIGUSR1, from a thread of its own.

        libfuse's loop never returns to Python in the main thread, so a Python signal
        handler would not run there; instead SIGUSR1 is blocked (before libfuse starts
        its threads, which inherit the mask) and one thread waits for it.
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

        def wait() -> None:
            while True:
                signal.sigwait({signal.SIGUSR1})
                self.dump()

        threading.Thread(target=wait, name="stfs-stats", daemon=True).start()


def counted(operations: Any, stats: Stats) -> Any:
    """``operations`` with each call of its methods counted under the method's name (what mfusepy is handed when
    stats are on; the callbacks stfs._native answers are counted there, by the names of mfusepy's wrappers)."""
    return _Counted(operations, stats)


class _Counted:
    def __init__(self, operations: Any, stats: Stats) -> None:
        self._operations = operations
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._operations, name)
        if not callable(value) or name.startswith("_") or getattr(value, "libfuse_ignore", False):
            return value
        count = self._stats.count_call

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            count(name)
            return value(*args, **kwargs)

        if name != "read":
            return call
        count_read = self._stats.count_read

        @functools.wraps(value)
        def read(path: str, size: int, offset: int, fh: int) -> bytes:
            data: bytes = call(path, size, offset, fh)
            count_read(size, len(data))
            return data

        return read


class _Counters:
    __slots__ = ("calls", "read_sizes", "read_bytes")

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.read_sizes: Counter[int] = Counter()
        self.read_bytes = 0


def hold_dump_signal() -> None:
    """With ``STFS_STATS`` set, block SIGUSR1 in this thread before any other starts (the source's clients,
    obstore's runtime, libfuse's workers inherit the mask): delivered to a thread that does not block it, its
    default action would end the daemon instead of dumping the counters."""
    if os.environ.get(ENVIRONMENT_VARIABLE):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def from_environment() -> Stats | None:
    path = os.environ.get(ENVIRONMENT_VARIABLE)
    return Stats(os.path.abspath(path)) if path else None
