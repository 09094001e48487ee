"""HTTPS bodies read without the GIL: ``stfs._tls`` over the SSL object that Python's ``ssl`` made.

Python's ``ssl`` hands over one TLS record (16 KiB at most) per call, each a GIL hand-off and three Python calls
under ``http.client``; ``stfs._tls.read_into`` fills a whole buffer in one call (see stfs/_tls.c for how it finds
the SSL object and what it checks first). Handshake, certificates and settings stay Python's. Where the extension
is not built (no compiler), cannot find OpenSSL's functions, does not recognise the socket, or ``STFS_NATIVE=0``
(the switch of stfs._native too), ``reader`` gives ``None`` and the body is read through ``ssl`` as before.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stfs")

try:
    import _ssl

    from stfs import _tls  # type: ignore[attr-defined]
except ImportError:  # built without a compiler
    _tls = None

SWITCHED_OFF = os.environ.get("STFS_NATIVE", "1") == "0"  # stfs._libfuse.NATIVE_VARIABLE, read the same way
AVAILABLE = bool(_tls is not None and not SWITCHED_OFF and _tls.bind(getattr(_ssl, "__file__", None)))
_said = False


def reader(sock: Any) -> Callable[[memoryview], int] | None:
    """A function filling a buffer from ``sock``'s TLS stream in one call (fewer bytes only where the peer closed
    it), or ``None`` where ``stfs._tls`` cannot read ``sock`` (then read it through ``ssl``)."""
    if not AVAILABLE or not isinstance(sock, ssl.SSLSocket):
        return None
    sslobj, context, fd = getattr(sock, "_sslobj", None), sock.context, sock.fileno()
    if sslobj is None or not _tls.usable(sslobj, sock, context, fd):
        return None
    timeout = sock.gettimeout()
    return lambda into: int(_tls.read_into(sslobj, sock, context, fd, into, timeout))


def say_once() -> None:
    """One log line, the first time an HTTPS client is made, where bodies are read through ``ssl``."""
    global _said
    if not AVAILABLE and not _said:
        _said = True
        why = "STFS_NATIVE=0" if SWITCHED_OFF else "stfs._tls is not available"
        log.info("HTTPS bodies are read through Python's ssl (%s): slower", why)
