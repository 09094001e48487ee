"""Whether the mount is being stopped (SIGTERM, SIGINT): work that can run long checks between its steps and gives
up, so that a stop waits neither for a whole tensor's summary nor for a server's retries.

libfuse's signal handlers only mark its session as exited; its loop ends once the requests it is serving return.
The FUSE layer hands ``watch`` that mark's check when the mount starts; until then nothing is ever stopping.
"""

from __future__ import annotations

from collections.abc import Callable


class Stopping(OSError):
    """Work given up because the mount is stopping (a read then fails with EIO, and the daemon exits)."""


def never() -> bool:
    return False


def always() -> bool:
    return True


_requested: Callable[[], bool] = never


def watch(requested: Callable[[], bool]) -> None:
    """Make ``give_up_if_requested`` ask ``requested``: the mount's own mark of being stopped."""
    global _requested
    _requested = requested


def give_up_if_requested(what: str) -> None:
    """Raise ``Stopping`` naming ``what`` if the mount is being stopped."""
    if _requested():
        raise Stopping(f"{what}: given up, the mount is stopping")
