"""How long a failed remote request is asked again: the backoff between attempts, and the few quick retries a refused
connection to this machine gets (nothing listens there, and nothing will soon). Pure: no I/O.

Every attempt a read makes counts against one deadline, ``--timeout`` from when the read began; retries wait
``FIRST_DELAY``, doubling up to ``MAX_DELAY``, and none starts that would end past the deadline.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterator

FIRST_DELAY = 0.05  # seconds before the first retry
MAX_DELAY = 1.0  # the longest wait between two attempts
REFUSED_NEARBY = 1.0  # seconds a refused connection to a loopback host is retried (a few quick attempts)


def delays() -> Iterator[float]:
    """The waits between attempts: ``FIRST_DELAY``, doubling up to ``MAX_DELAY``, for ever."""
    delay = FIRST_DELAY
    while True:
        yield delay
        delay = min(delay * 2, MAX_DELAY)


def attempts_within(seconds: float) -> int:
    """The most attempts one run of retries makes within ``seconds`` (requests taking no time at all)."""
    attempts, elapsed = 1, 0.0
    for delay in delays():
        if elapsed + delay >= seconds:
            return attempts
        elapsed += delay
        attempts += 1
    raise AssertionError("unreachable")


class Deadline:
    """When a fetch gives up: the latest deadline of the reads waiting for it (a read that joins it moves it on, so
    that no read is failed by a deadline other than its own)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at

    def extend(self, at: float) -> None:
        self.at = max(self.at, at)


def is_loopback(url: str | None) -> bool:
    """Whether ``url``'s host is this machine (``localhost``, 127.0.0.0/8, ``[::1]``)."""
    if not url:
        return False
    try:
        host = urllib.parse.urlsplit(url).hostname
    except ValueError:
        return False
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
