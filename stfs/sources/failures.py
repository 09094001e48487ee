"""Why a remote request failed, in one line, and what to do about it: a retry, a failure at once, or a changed object.

Failures come from obstore (a Rust error whose cause is only in its debug text), from huggingface_hub and its
HTTP client (exceptions chained down to the stdlib's ``ConnectionRefusedError``, ``socket.gaierror``,
``ssl.SSLCertVerificationError``), or from a stdlib client; ``describe`` reads all three. Pure: no I/O.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

# What a failure means for the request that met it.
RETRY = "retry"  # resets, timeouts, 5xx, 429: ask again with backoff until the timeout
UNREACHABLE = "unreachable"  # connection refused, a name that does not resolve: retried once a file is pinned
FATAL = "fatal"  # asking again will not help: a certificate, 401/403, another 4xx
GONE = "gone"  # 404
CHANGED = "changed"  # 412: If-Match failed
NO_RANGE = "no-range"  # 200 or 416 to a Range request

TRUST_HINT = "SSL_CERT_FILE names a CA bundle to trust"

_STATUS = re.compile(r"status code: (\d{3})|\bstatus: (\d{3}),")
_CERTIFICATE = re.compile(r"InvalidCertificate\(\s*(\w+)|certificate verify failed: ([^()\]\n]+)", re.IGNORECASE)
_NO_NAME = re.compile(r"dns error|failed to lookup address|Name or service not known|name resolution", re.IGNORECASE)
_REFUSED = re.compile(r"Connection ?refused", re.IGNORECASE)
_TIMEOUT = re.compile(r"kind: Timeout|TimedOut|timed out|operation timed out", re.IGNORECASE)
_RESET = re.compile(r"Connection ?reset|broken pipe|connection closed|IncompleteMessage|unexpected EOF", re.IGNORECASE)
_NO_RANGE_TEXT = ("RangeNotSupported", "Range request not supported", "NotPartial")
_FATAL_NAMES = (
    "PermissionDeniedError",
    "UnauthenticatedError",
    "InvalidPathError",
    "NotSupportedError",
    "UnknownConfigurationKeyError",
)


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed request: ``kind`` (one of the constants above) and ``cause``, one line for a person."""

    kind: str
    cause: str


def describe(exc: BaseException) -> Failure:
    """What ``exc`` (a failed request, of any client) means and says."""
    chain = list(_chain(exc))
    text = "\n".join(str(link) for link in chain)
    names = {type(link).__name__ for link in chain}
    status = _status(text)
    certificate = _CERTIFICATE.search(text)
    if certificate or any(isinstance(link, ssl.SSLCertVerificationError) for link in chain):
        detail = next((group for group in certificate.groups() if group), "") if certificate else ""
        detail = f" ({detail.strip()})" if detail else ""
        return Failure(FATAL, f"the server's certificate does not verify{detail}; {TRUST_HINT}")
    if "FileNotFoundError" in names or "NotFoundError" in names or status == 404:
        return Failure(GONE, "no such bucket (HTTP 404)" if "NoSuchBucket" in text else "not found (HTTP 404)")
    if "PreconditionError" in names or status == 412:
        return Failure(CHANGED, "the object changed (HTTP 412: If-Match failed)")
    if any(marker in text for marker in _NO_RANGE_TEXT) or status == 416:
        return Failure(NO_RANGE, "the server did not answer with the range asked for")
    if status in (401, 403) or "UnauthenticatedError" in names or "PermissionDeniedError" in names:
        code = f"HTTP {status}" if status else "denied"
        return Failure(FATAL, f"access denied ({code}): credentials or a token that grants access are needed")
    if status == 429 or (status is not None and status >= 500):
        return Failure(RETRY, f"the server answered HTTP {status}")
    if status is not None and status >= 400 and status != 408:
        return Failure(FATAL, f"the server answered HTTP {status}")
    if any(isinstance(link, socket.gaierror) for link in chain) or _NO_NAME.search(text):
        return Failure(UNREACHABLE, "the host name does not resolve")
    if any(isinstance(link, ConnectionRefusedError) for link in chain) or _REFUSED.search(text):
        return Failure(UNREACHABLE, "connection refused (nothing listens at that address and port)")
    if any(isinstance(link, TimeoutError) for link in chain) or status == 408 or _TIMEOUT.search(text):
        return Failure(RETRY, "no answer from the server in time")
    if any(isinstance(link, ConnectionResetError) for link in chain) or _RESET.search(text):
        return Failure(RETRY, "the connection was reset")
    if names & set(_FATAL_NAMES):
        return Failure(FATAL, first_line(exc))
    return Failure(RETRY, first_line(exc))


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a refused connection (nothing listens at that address and port)."""
    chain = list(_chain(exc))
    return any(isinstance(link, ConnectionRefusedError) for link in chain) or any(
        _REFUSED.search(str(link)) for link in chain
    )


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (obstore's run to a page of debug text), at most 300 characters."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes (``raise ... from``, as the HTTP clients chain them); not the exceptions being
    handled when it was raised, which may be other failures."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__


def _status(text: str) -> int | None:
    match = _STATUS.search(text)
    return int(match.group(1) or match.group(2)) if match else None
