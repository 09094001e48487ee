"""Keep secrets out of ``/proc/PID/cmdline``: a URL's password given on the command line is overwritten in place.

The kernel shows a process's command line from its own memory (``arg_start``..``arg_end`` in
``/proc/PID/stat``), so the daemon, forked from ``stfs mount URL``, would show the URL as typed. A
process may write its own memory through ``/proc/self/mem``: each secret is replaced there by ``*``s.
"""

from __future__ import annotations

import logging
import urllib.parse

log = logging.getLogger(__name__)


def _argument_area() -> tuple[int, int]:
    with open("/proc/self/stat", "rb") as stream:
        fields = stream.read().rsplit(b")", 1)[1].split()
    # fields after the command name start at field 3 (state); arg_start and arg_end are fields 48 and 49
    return int(fields[48 - 3]), int(fields[49 - 3])


def hide_from_command_line(secrets: list[str]) -> None:
    """Overwrite every occurrence of each secret in this process's command line with ``*``."""
    secrets = [secret for secret in secrets if secret]
    if not secrets:
        return
    try:
        start, end = _argument_area()
        with open("/proc/self/mem", "r+b", buffering=0) as memory:
            memory.seek(start)
            area = bytearray(memory.read(end - start))
            for secret in secrets:
                encoded = secret.encode("utf-8", "surrogateescape")
                area = area.replace(encoded, b"*" * len(encoded))
                quoted = _percent_encoded(secret)
                if quoted != encoded:
                    area = area.replace(quoted, b"*" * len(quoted))
            memory.seek(start)
            memory.write(bytes(area))
    except (OSError, ValueError, IndexError) as exc:
        log.warning("cannot hide the URL's credentials from the command line: %s", exc)


def _percent_encoded(secret: str) -> bytes:
    from urllib.parse import quote

    return quote(secret, safe="").encode()


def secrets_of(text: str) -> list[str]:
    """The parts of a SOURCE that must never be shown: an HTTP(S) URL's password and its query (a presigned
    URL's signature)."""
    if not text.startswith(("http://", "https://")):
        return []
    parts = urllib.parse.urlsplit(text)
    return [secret for secret in (parts.password, parts.query) if secret]
