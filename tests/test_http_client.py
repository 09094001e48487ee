"""stfs.sources.http_client against nginx on 127.0.0.1: a large body read with the socket's low-water mark raised
(``SO_RCVLOWAT``) comes whole and byte-exact, the kept-alive connection then answers a small request at once (the
mark is down again), and a body cut short fails instead of waiting for bytes that never come. A large body is read
in one call without the GIL (stfs._tls's ``recv_into``) where the extension is there, through ``socket`` otherwise:
the same bytes either way, from many threads at once, over a fast link and a slow one."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from stfs.sources.http_client import LOW_WATER, SLICE, HttpClient
from tests.remote_helpers import MIB
from tests.servers import FaultProxy, Nginx

pytestmark = pytest.mark.timeout(60)

SKIP = 1000  # the ranges start inside the file


@pytest.mark.parametrize("size", [2 * LOW_WATER, 2 * LOW_WATER + 1, 3 * LOW_WATER + 12345, 8 * MIB])
def test_a_large_body_then_a_small_one_on_the_same_connection(size: int, nginx: Nginx) -> None:
    data = os.urandom(SKIP + size)
    nginx.put("blob", data)
    client = HttpClient(nginx.url, {}, timeout=3.0)  # a mark left up would hold the small read until this timeout
    try:
        into = memoryview(bytearray(size))
        client.get_into("blob", SKIP, into)
        assert into == data[SKIP:]
        small = memoryview(bytearray(10))
        client.get_into("blob", 5, small)
        assert small == data[5:15]
    finally:
        client.close()
    entries = nginx.log.entries(at_least=2)  # nginx logs a request a moment after its response
    assert len(entries) == 2 and entries[0].connection == entries[1].connection  # one kept-alive connection


def test_a_body_cut_short_fails_at_once(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    nginx.put("blob", os.urandom(8 * MIB))
    proxy = fault_proxy(nginx.url)
    proxy.reset_next(1, after_bytes=3 * MIB)  # inside the part read with the mark up
    client = HttpClient(proxy.url, {}, timeout=120.0)  # longer than the test may take: a wait fails it
    try:
        with pytest.raises(OSError):
            client.get_into("blob", 0, memoryview(bytearray(8 * MIB)))
        into = memoryview(bytearray(8 * MIB))
        client.get_into("blob", 0, into)  # the next request, on a new connection, is whole
        assert into == (nginx.root / "blob").read_bytes()
    finally:
        client.close()


def test_a_large_body_from_a_server_that_closes_the_connection(nginx: Nginx) -> None:
    """A response that ends its connection (``Connection: close``, as moto's server and some proxies answer): the
    body is read without the low-water mark (http.client has handed the socket to the response), and the next
    request opens a new connection."""
    data = os.urandom(SKIP + 4 * MIB)
    nginx.put("blob", data)
    client = HttpClient(nginx.url, {"Connection": "close"}, timeout=3.0)
    try:
        for _ in range(2):
            into = memoryview(bytearray(4 * MIB))
            client.get_into("blob", SKIP, into)
            assert into == data[SKIP:]
    finally:
        client.close()
    entries = nginx.log.entries(at_least=2)  # nginx logs a request a moment after its response
    assert len(entries) == 2 and entries[0].connection != entries[1].connection


def _ranges_from_threads(client: HttpClient, data: bytes, count: int, threads: int) -> list[tuple[int, bytes]]:
    """``count`` random ranges of ``data`` (``blob`` on the server), many larger than two low-water marks, read by
    ``threads`` threads at once through ``client``; each range's start and the bytes read."""
    rng = random.Random(53)
    ranges = [
        (rng.randrange(len(data) - MIB), rng.choice([7, SLICE, 2 * LOW_WATER + 1, 3 * LOW_WATER + 999]))
        for _ in range(count)
    ]

    def read(lo_size: tuple[int, int]) -> tuple[int, bytes]:
        lo, size = lo_size
        size = min(size, len(data) - lo)
        into = memoryview(bytearray(size))
        client.get_into("blob", lo, into)
        return lo, bytes(into)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(read, ranges))


def test_ranges_read_by_many_threads_are_exact(nginx: Nginx) -> None:
    data = os.urandom(24 * MIB)
    nginx.put("blob", data)
    client = HttpClient(nginx.url, {}, timeout=10.0)
    try:
        for lo, got in _ranges_from_threads(client, data, count=40, threads=8):
            assert got == data[lo : lo + len(got)]
    finally:
        client.close()
    assert 0 < len({entry.connection for entry in nginx.log.entries(at_least=40)}) <= 8  # connections kept


def test_a_slow_link_reports_its_bytes_as_they_come(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    """Over a link too slow for the low-water mark (the first slice came slowly), the body is read a slice at a
    time, each reported to ``progress``: a reader waiting on it sees the link move."""
    size = 2 * LOW_WATER + 4321
    data = os.urandom(SKIP + size)
    nginx.put("blob", data)
    proxy = fault_proxy(nginx.url)
    proxy.set_rate(MIB)  # a slice in 0.25 s: 1 MiB would take 1 s, over an eighth of the 4 s timeout
    client = HttpClient(proxy.url, {}, timeout=4.0)
    pieces: list[int] = []
    try:
        into = memoryview(bytearray(size))
        client.get_into("blob", SKIP, into, progress=pieces.append)
    finally:
        client.close()
    assert into == data[SKIP:]
    assert sum(pieces) == size and len(pieces) >= size // SLICE and max(pieces) <= SLICE
