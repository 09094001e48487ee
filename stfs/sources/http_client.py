"""Ranged GETs read straight into memory the caller gives: ``http.client``'s ``readinto`` over kept-alive
connections to one HTTP(S) server.

obstore assembles every answer into a fresh buffer of its own (a copy and a page fault per fresh page);
here the socket (or TLS) is read into the block cache's slot itself, the one user-space copy of a byte.
HTTPS trusts the system's CA store, ``SSL_CERT_FILE`` honoured (OpenSSL's default paths).

``query`` (a presigned URL's ``X-Amz-Signature=…``) goes with every request and is a secret: it is in no
message this module makes.
"""

from __future__ import annotations

import functools
import http.client
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable

from stfs.sources import tls

LOW_WATER = 1 << 20  # SO_RCVLOWAT while a large body is read: a wake-up (and a GIL hand-off) per MiB, not per packet
MAX_REDIRECTS = 5  # a file's redirects followed on the first server before one leaves it
SLICE = 256 << 10  # a body is read in pieces of this, each reported to ``progress``: a slow link shows it is moving


class StatusError(OSError):
    """The server answered with a status a ranged GET cannot use; the message says ``status code: N``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class PreconditionError(StatusError):
    """412: the object is no longer the version pinned (``If-Match`` failed)."""


class HttpClient:
    """GETs of byte ranges of one server's files, each read into a buffer given (see the module docstring)."""

    def __init__(self, base: str, headers: dict[str, str], timeout: float, query: str = "") -> None:
        parts = urllib.parse.urlsplit(base)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.headers = {"Accept-Encoding": "identity", **headers}
        self.timeout = timeout
        self.query = query
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self._context = https_context() if self.https else None
        if self.https:
            tls.say_once()
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get_into(
        self,
        path: str,
        lo: int,
        into: memoryview,
        etag: str | None = None,
        progress: Callable[[int], None] | None = None,
        query: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Fill ``into`` with the bytes of ``/path`` from ``lo`` (one ``Range`` GET, ``If-Match: etag``); each piece
        of the body read is reported to ``progress`` (its length) as it arrives. ``query``: this request's, in place
        of the client's (a secret as that one is); ``headers``: this request's besides the client's (a token)."""
        hi = lo + len(into)
        headers = dict(self.headers, **(headers or {}), Range=f"bytes={lo}-{hi - 1}")
        if etag:
            headers["If-Match"] = etag
        target = _target(path, self.query if query is None else query)
        connection = self._connection()
        try:
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
            if response.status != 206:
                response.read(64 * 1024)  # a small error body; a whole file (200) is never read
                connection.close()
                raise _status_error(response, path, lo, hi)
            expected = f"bytes {lo}-{hi - 1}/"
            content_range = response.getheader("Content-Range", "")
            if not content_range.startswith(expected):
                connection.close()
                raise OSError(f"asked for bytes {lo}-{hi}, the server sent {content_range or 'no Content-Range'}")
            told = progress or _ignore
            done = 0
            # a response that ends its connection has taken the socket from it (http.client): no mark to set there
            if not self.https and len(into) > 2 * LOW_WATER and connection.sock is not None:
                done = _read_batched(response, connection, into, self.timeout, told)
            elif self.https and len(into) > SLICE:
                done = _read_tls(response, connection.sock, into, self.timeout, told)
            while done < len(into):
                done += _read_piece(response, into, done, min(len(into), done + SLICE), told)
        except BaseException:
            connection.close()
            raise
        self._keep(connection)

    def locate(self, path: str) -> str | None:
        """Where ``/path`` (with its ``?query``, if any) redirects to (a HEAD, not followed): the ``Location`` of a
        3xx, ``None`` for a 2xx."""
        path, _, query = path.partition("?")
        connection = self._connection()
        try:
            connection.request("HEAD", _target(path, query or self.query), headers=self.headers)
            response = connection.getresponse()
            response.read()
            location = response.getheader("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                self._keep(connection)
                return location
            if 200 <= response.status < 300:
                self._keep(connection)
                return None
            connection.close()
            message = f"HEAD of /{path.lstrip('/')}: the server answered with status code: {response.status} "
            raise StatusError(message + str(response.reason), response.status)
        except BaseException:
            connection.close()
            raise

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _connection(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._context)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _keep(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(connection)


def https_context() -> ssl.SSLContext:
    """The context of every HTTPS connection in the process (one for each ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` it
    has seen): making one loads the CA store, 44 ms of CPU for the system's 145 certificates with OpenSSL 3.0 (a tenth
    of a 128 MiB read over HTTPS), and one context serves any number of connections and threads."""
    return _context_for(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _context_for(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return ssl.create_default_context()  # OpenSSL reads both variables itself


class PlacedClient:
    """Ranged GETs of files each read from a place found once per file (``_find``: a URL signed for it), and found
    again, once, where it stops working (401, 403, 404, 410: it expired). Places are secrets (their queries sign
    them): in no message."""

    _first: HttpClient | None = None  # a file found in place there is not looked for again on a failure

    def __init__(self, headers: dict[str, str], timeout: float, max_age: float = float("inf")) -> None:
        self._plain = {name: value for name, value in headers.items() if name.lower() != "authorization"}
        self._timeout = timeout
        self._max_age = max_age  # seconds a place is used before it is found again (a signature's lifetime)
        self._clients: dict[str, HttpClient] = {}  # "scheme://host:port" -> its client
        self._places: dict[str, tuple[HttpClient, str, str, float]] = {}  # file -> (client, path, query, found at)
        self._lock = threading.Lock()
        self.lookups = 0  # requests made to find places: besides the GETs the caller counts

    def get_into(
        self,
        path: str,
        lo: int,
        into: memoryview,
        etag: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """As ``HttpClient.get_into``, of the file ``path`` where it was found."""
        for again in (False, True):
            client, target, query = self._place(path, again)
            try:
                client.get_into(target, lo, into, etag, progress, query=query, headers=self._headers(client))
                return
            except StatusError as exc:
                if again or exc.status not in (401, 403, 404, 410) or not self._ask_again(client, exc.status):
                    raise

    def _headers(self, client: HttpClient) -> dict[str, str] | None:
        """Headers of a GET from ``client`` besides its own (none: a place is signed, or public)."""
        return None

    def _ask_again(self, client: HttpClient, status: int) -> bool:
        """Whether a GET ``client`` refused with ``status`` (401, 403, 404, 410) is worth a place found anew: where
        the place expired, not where the first server itself refused."""
        return client is not self._first

    def close(self) -> None:
        with self._lock:
            clients = [*([self._first] if self._first else []), *self._clients.values()]
        for client in clients:
            client.close()

    def _find(self, path: str) -> tuple[HttpClient, str, str]:
        raise NotImplementedError

    def _place(self, path: str, again: bool) -> tuple[HttpClient, str, str]:
        with self._lock:
            found = self._places.get(path)
        now = time.monotonic()
        if found is not None and not again and now - found[3] < self._max_age:
            return found[:3]
        client, target, query = self._find(path)
        with self._lock:
            self._places[path] = (client, target, query, now)
        return client, target, query

    def _client_at(self, url: str) -> tuple[HttpClient, str, str]:
        """The client of ``url``'s origin (made once, without the token), its path and its query."""
        parts = urllib.parse.urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        with self._lock:
            client = self._clients.get(origin)
            if client is None:
                client = self._clients[origin] = HttpClient(origin, self._plain, self._timeout)
        return client, parts.path, parts.query


class ResolvingClient(PlacedClient):
    """Ranged GETs of files served through a redirect (the Hub's ``resolve/`` URLs answer with a signed URL of its
    CDN): a file's redirect is asked for once (a HEAD, with the token), then its ranges are read from where it
    points, without the token (the URL is signed) and without a redirect a block. A file served in place (a 2xx,
    no redirect) is read from the first server."""

    def __init__(self, endpoint: str, prefix: str, headers: dict[str, str], timeout: float) -> None:
        super().__init__(headers, timeout)
        self._first = HttpClient(endpoint, headers, timeout)
        self._prefix = urllib.parse.urlsplit(endpoint).path.rstrip("/") + prefix  # "/org/repo/resolve/COMMIT/"

    def _find(self, path: str) -> tuple[HttpClient, str, str]:
        first = self._first
        assert first is not None
        here, query = self._prefix + path.lstrip("/"), ""
        for _ in range(MAX_REDIRECTS):  # the first server's own redirects (a renamed repository) keep the token
            with self._lock:
                self.lookups += 1
            location = first.locate(here if not query else f"{here}?{query}")
            if location is None:
                return first, here, query
            url = urllib.parse.urljoin(first.origin + here, location)
            parts = urllib.parse.urlsplit(url)
            if f"{parts.scheme}://{parts.netloc}" != first.origin:
                return self._client_at(url)
            here, query = parts.path, parts.query
        raise OSError(f"/{path}: more than {MAX_REDIRECTS} redirects")


class SignedClient(PlacedClient):
    """Ranged GETs of presigned URLs (S3's): ``sign(path)`` gives a file's URL, signed for ``lifetime`` seconds; it
    is used for half of that, then signed again (signing makes no request), and once more where it stops working.
    The signature is in the URL, so the client holds no credentials."""

    def __init__(self, sign: Callable[[str, float], str], lifetime: float, timeout: float) -> None:
        super().__init__({}, timeout, max_age=lifetime / 2)
        self._sign = sign
        self._lifetime = lifetime

    def _find(self, path: str) -> tuple[HttpClient, str, str]:
        return self._client_at(self._sign(path, self._lifetime))


def _target(path: str, query: str) -> str:
    target = "/" + urllib.parse.quote(path.lstrip("/"), safe="/%:@!$&'()*+,;=-._~")
    return target + "?" + query if query else target


def _ignore(count: int) -> None:
    pass


def _read_piece(
    response: http.client.HTTPResponse, into: memoryview, start: int, end: int, progress: Callable[[int], None]
) -> int:
    """Read bytes ``[start, end)`` of the body into ``into``; their count, reported to ``progress``."""
    got = response.readinto(into[start:end])
    if not got:
        raise OSError(f"the connection closed after {start} of {len(into)} bytes")  # the caller closes it
    progress(got)
    return got


def _read_batched(
    response: http.client.HTTPResponse,
    connection: http.client.HTTPConnection,
    into: memoryview,
    timeout: float,
    progress: Callable[[int], None],
) -> int:
    """Read all but the last ``LOW_WATER`` bytes of the body into ``into`` with the socket's low-water mark at
    ``LOW_WATER`` (each wake-up brings at least that much); the count read. The mark is back at 1 byte before the
    tail: more than the mark is still to come from the socket throughout, so no read waits for bytes never sent.
    Plain HTTP only: TLS takes bytes off the socket ahead of what it hands over.

    Only on a link that brought the first ``SLICE`` fast enough for ``LOW_WATER`` to come well within ``timeout``:
    with the mark set a read waits for that much, and on a slower link it would time out while bytes still come.
    """
    started = time.monotonic()
    done = _read_piece(response, into, 0, SLICE, progress)
    if (time.monotonic() - started) * (LOW_WATER / done) * 8 > timeout:
        return done  # a slow link: the rest one slice at a time, no mark
    sock = connection.sock
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, LOW_WATER)
    while done < len(into) - LOW_WATER:
        done += _read_piece(response, into, done, min(done + LOW_WATER, len(into) - LOW_WATER), progress)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return done


def _read_tls(
    response: http.client.HTTPResponse,
    sock: socket.socket | None,
    into: memoryview,
    timeout: float,
    progress: Callable[[int], None],
) -> int:
    """Read all but the last byte of the body into ``into``: what ``http.client``'s reader holds already, then the
    rest from ``sock``'s TLS stream (stfs.sources.tls): in one call where the first ``SLICE`` came fast enough for
    the whole body to come well within ``timeout``, else in one call a ``SLICE`` (each reported to ``progress``: a
    slow link shows it is moving); the count read, 0 where that cannot read ``sock``. The last byte is left to
    ``http.client``, which then ends the response itself (the connection can be kept)."""
    read = tls.reader(sock) if response.length == len(into) else None  # not chunked: the stream holds the body alone
    if read is None:
        return 0
    held = len(response.fp.peek())  # the body's first bytes, read with the headers (or a record, if none was)
    done = _read_piece(response, into, 0, min(held, len(into) - 1), progress) if held else 0
    step = SLICE
    while done < len(into) - 1:
        started = time.monotonic()
        got = read(into[done : min(done + step, len(into) - 1)])
        if not got:
            raise OSError(f"the connection closed after {done} of {len(into)} bytes")  # the caller closes it
        if step == SLICE and (time.monotonic() - started) * (len(into) / got) * 8 <= timeout:
            step = len(into)  # a fast link: the rest in one call
        response.length = len(into) - done - got  # what http.client still expects: it ends the response at 0
        progress(got)
        done += got
    return done


def _status_error(response: http.client.HTTPResponse, path: str, lo: int, hi: int) -> StatusError:
    status = response.status
    where = f"GET of bytes {lo}-{hi} of /{path.lstrip('/')}"
    if status == 200:
        return StatusError(f"{where}: Range request not supported (the server answered 200, the whole file)", 200)
    message = f"{where}: the server answered with status code: {status} {response.reason}"
    if status == 412:
        return PreconditionError(message, status)
    return StatusError(message, status)
