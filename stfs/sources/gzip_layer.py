"""A gzip'd tar layer read at random (SPEC §14a): one streaming pass keeps a seek index, reads start from it.

The pass reads the blob once from the start (by Range, through the source below: its block cache and readahead)
and lists the tar's members while ``indexed_gzip`` (zlib's ``zran``: a restart point every ``SPACING`` bytes of
output, each the deflate position and the 32 KiB window before it) records where decompression can start again.
A read then decompresses from the restart point before it, ``CHUNK`` bytes at a time, the last few chunks kept.
With ``--cache-dir`` the index and the member list are kept there by the blob's digest (``layer_index``: content
addressed, never stale; within ``--cache-dir-size``), so a later mount reads none of the pass again; a kept index
that does not match its blob is said in one line and made again. Why ``indexed_gzip`` rather than rapidgzip or a C
helper: docs/choices.md.
"""

from __future__ import annotations

import io
import logging
import os
import zlib
from collections import OrderedDict
from typing import Any

from . import layer_index
from .compressed_layer import CompressedLayer
from .tar_index import MAX_MEMBERS, Entry, TarIndexError, _RangeFile, entries

log = logging.getLogger(__name__)

SPACING = 4 << 20  # bytes of output between restart points (SPEC: at most 4 MiB)
CHUNK = 4 << 20  # bytes decompressed at once for reads; the last CHUNKS_KEPT chunks kept
CHUNKS_KEPT = 4
READ_BUFFER = 1 << 20  # compressed bytes asked of the source at once
MAX_RATIO = 256  # a layer inflating past this many times its size (plus SLACK) is a bomb: refused
SLACK = 64 << 20
INDEX_FOLDER = "gzip-index"
_BOMB = f"{MAX_RATIO} times the size of its gzip layer (a gzip bomb?)"


class GzipLayer(CompressedLayer):
    """The decompressed stream of the gzip blob ``key`` (``size`` bytes, ``digest``) that ``read(key, offset,
    count)`` reads; ``scan()`` makes or loads its index and gives the tar's members, ``read_at`` its bytes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._name = layer_index.kept_name(INDEX_FOLDER, self.digest, ".index")
        self._file: object | None = None
        self._chunks: OrderedDict[int, bytes] = OrderedDict()
        self.bound = self.size * MAX_RATIO + SLACK

    # -- the pass

    def scan(self) -> list[Entry]:
        """The tar's members, from the kept index when there is one that matches, else by the one pass; a
        ``TarIndexError`` saying why the layer cannot be read."""
        kept = self._load()
        if kept is not None:
            return kept
        import indexed_gzip

        counted = _Counted(self, _RangeFile(lambda lo, n: self._read(self.key, lo, n), self.size), _Members(self.bound))
        source = io.BufferedReader(counted)
        stream = indexed_gzip.IndexedGzipFile(
            fileobj=source, spacing=SPACING, readbuf_size=READ_BUFFER, buffer_size=64 << 10, auto_build=True
        )
        try:
            found = list(entries(stream, self.bound, MAX_MEMBERS, _BOMB))
            while stream.read(READ_BUFFER):  # to the stream's end: its CRC and length checked, the rest bounded
                if stream.tell() > self.bound:
                    raise TarIndexError(f"the stream inflates past {_BOMB}")
            self._check_end(stream.tell(), found, counted.members)
            raw = stream.detach()  # the _IndexedGzipFile below the buffer: reads keep chunks of their own
        except TarIndexError as exc:
            raise TarIndexError(_said(counted.members.error or exc)) from None
        except Exception as exc:  # zran's errors (ZranError, CrcError, …) and the source's
            raise TarIndexError(_said(counted.members.error or exc)) from None
        self._file = raw
        self._save(raw, found)
        return found

    def _check_end(self, total: int, found: list[Entry], checked: _Members) -> None:
        """The stream is whole: every member ends within its ``total`` bytes, and ``checked`` (the blob's bytes as
        zran read them, inflated by ``zlib`` too) found its members whole, making as much."""
        for entry in found:
            if entry.kind == "file" and entry.offset + entry.size > total:
                raise TarIndexError(f"member {entry.path!r} ends past the stream's end (byte {total}): it is cut short")
        if checked.position != self.size:  # zran read it otherwise than front to back: inflated once more here
            checked = _Members(self.bound)
            for lo in range(0, self.size, READ_BUFFER):
                checked.feed(self._read(self.key, lo, min(READ_BUFFER, self.size - lo)))
        if checked.finish() != total:
            raise TarIndexError("its gzip members inflate to another length than the stream read")

    # -- reads

    def read_at(self, offset: int, count: int) -> bytes:
        """``count`` bytes of the decompressed stream from ``offset`` (fewer at its end); an ``OSError`` where the
        blob cannot be read or decompressed."""
        parts = []
        end = offset + count
        while offset < end:
            number = offset // CHUNK
            chunk = self._chunk(number)
            piece = chunk[offset - number * CHUNK : end - number * CHUNK]
            if not piece:
                break
            parts.append(piece)
            offset += len(piece)
        return b"".join(parts)

    def _chunk(self, number: int) -> bytes:
        with self._lock:
            chunk = self._chunks.get(number)
            if chunk is not None:
                self._chunks.move_to_end(number)
                return chunk
            file = self._opened()
            try:
                file.seek(number * CHUNK)  # type: ignore[attr-defined]
                chunk = bytes(file.read(CHUNK))  # type: ignore[attr-defined]
            except Exception as exc:
                raise OSError(f"{self.digest}: cannot decompress: {_said(exc)}") from None
            self._chunks[number] = chunk
            if len(self._chunks) > CHUNKS_KEPT:
                self._chunks.popitem(last=False)
            return chunk

    def _opened(self) -> object:
        if self._file is None:
            raise OSError(f"{self.digest}: read before its index was made")
        return self._file

    def close(self) -> None:
        file = self._file
        self._file = None
        if file is not None:
            file.close()  # type: ignore[attr-defined]

    # -- the index kept in --cache-dir

    def _load(self) -> list[Entry] | None:
        if self._disk is None:
            return None
        import indexed_gzip

        try:
            kept = layer_index.load(self._disk, self._name, self.size)
            if kept is None:
                return None
            found, _, index = kept
            source = io.BufferedReader(_RangeFile(lambda lo, n: self._read(self.key, lo, n), self.size))
            file = indexed_gzip._IndexedGzipFile(fileobj=source, spacing=SPACING, readbuf_size=READ_BUFFER)
            file.import_index(fileobj=io.BytesIO(index))
        except Exception as exc:
            self._disk.drop_file(self._name)
            self.warnings.append(
                f"{os.path.join(self._disk.folder, self._name)}: the gzip index kept for blob {self.digest} does not "
                f"match it ({_said(exc)}): made again"
            )
            return None
        self._file = file
        return found

    def _save(self, file: object, found: list[Entry]) -> None:
        if self._disk is None:
            return
        buffer = io.BytesIO()
        try:
            file.export_index(fileobj=buffer)  # type: ignore[attr-defined]
        except OSError as exc:
            log.warning("cannot keep the gzip index of %s: %s", self.digest, exc.strerror or exc)
            return
        layer_index.save(self._disk, self._name, self.size, found, {}, buffer.getvalue())


class _Counted(io.RawIOBase):
    """A raw file passing on its reads, telling the progress bar how many bytes came and ``members`` what they are
    while they come in order."""

    def __init__(self, layer: GzipLayer, below: _RangeFile, members: _Members) -> None:
        self._layer = layer
        self._below = below
        self.members = members

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._below.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._below.seek(offset, whence)

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        at = self._below.tell()
        got = self._below.readinto(buffer)
        known = self.members.position
        if at <= known < at + got:  # zran reads again from a restart point at times: only what is new is fed
            if self.members.error is None:
                try:
                    self.members.feed(memoryview(buffer)[known - at : got])
                except TarIndexError as exc:  # said once zran is back: raised through it, it would be zran's
                    self.members.error = exc
            self.members.position = at + got
            if self._layer._progress is not None:
                self._layer._progress(at + got - known)
        return got


class _Members:
    """The gzip members of a blob inflated by ``zlib`` as its bytes come, in order, CRCs checked: ``total`` the
    bytes they make; a ``TarIndexError`` for a member cut short, or bytes after the last that are neither a member
    nor zero padding. (zran stops quietly at both: this is what says the stream is whole.)"""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.total = 0
        self.position = 0  # bytes fed
        self._decoder: Any = None  # the member being inflated
        self._padding = False
        self.error: TarIndexError | None = None

    def feed(self, piece: bytes | memoryview) -> None:
        self.position += len(piece)
        data = bytes(piece)
        while data:
            if self._padding or (self._decoder is None and data[0] == 0):
                if data.strip(b"\0"):
                    raise TarIndexError("bytes that are not gzip follow its zero padding")
                self._padding = True
                return
            if self._decoder is None:
                self._decoder = zlib.decompressobj(31)
            try:
                self.total += len(self._decoder.decompress(data, READ_BUFFER))  # a bounded piece at a time
            except zlib.error as exc:
                raise TarIndexError(f"the gzip member before byte {self.position}: {exc}") from None
            if self.total > self.bound:
                raise TarIndexError(f"the stream inflates past {_BOMB}")
            if self._decoder.eof:
                data, self._decoder = self._decoder.unused_data, None
            else:
                data = self._decoder.unconsumed_tail

    def finish(self) -> int:
        if self.error is not None:
            raise self.error
        if self._decoder is not None:
            raise TarIndexError("the gzip stream is cut short (its last member has no end)")
        return self.total


def _said(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
