"""stfs.sources.http_client against nginx on 127.0.0.1: a large body read with the socket's low-water mark raised
(``SO_RCVLOWAT``) comes whole and byte-exact, the kept-alive connection then answers a small request at once (the
mark is down again), and a body cut short fails instead of waiting for bytes that never come."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from stfs.sources.http_client import LOW_WATER, HttpClient
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
