"""A gzip'd tar layer read at random (SPEC §14a): one streaming pass keeps a seek index, reads start from it.

The pass reads the blob once from the start (by Range, through the source below: its block cache and readahead)
and lists the tar's members while ``indexed_gzip`` (zlib's ``zran``: a restart point every ``SPACING`` bytes of
output, each the deflate position and the 32 KiB window before it) records where decompression can start again.
A read then decompresses from the restart point before it, ``CHUNK`` bytes at a time, the last few chunks kept.
With ``--cache-dir`` the index and the member list are kept there by the blob's digest (content addressed: never
stale), so a later mount reads none of the pass again; a kept index that does not match its blob is said in one
line and made again. Why ``indexed_gzip`` rather than rapidgzip or a C helper: docs/choices.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from .tar_index import Entry, TarIndexError, _RangeFile, entries

log = logging.getLogger(__name__)

SPACING = 4 << 20  # bytes of output between restart points (SPEC: at most 4 MiB)
CHUNK = 4 << 20  # bytes decompressed at once for reads; the last CHUNKS_KEPT chunks kept
CHUNKS_KEPT = 4
READ_BUFFER = 1 << 20  # compressed bytes asked of the source at once
MAX_RATIO = 256  # a layer inflating past this many times its size (plus SLACK) is a bomb: refused
SLACK = 64 << 20
MAX_ENTRIES = 200_000  # members of one layer: their list stays in memory
INDEX_FOLDER = "gzip-index"
FORMAT = 1
_BOMB = f"{MAX_RATIO} times the size of its gzip layer (a gzip bomb?)"


class GzipLayer:
    """The decompressed stream of the gzip blob ``key`` (``size`` bytes, ``digest``) that ``read(key, offset,
    count)`` reads; ``scan()`` makes or loads its index and gives the tar's members, ``read_at`` its bytes."""

    def __init__(
        self,
        read: Callable[[str, int, int], bytes],
        key: str,
        size: int,
        digest: str,
        cache_folder: str | None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.key = key
        self.size = size
        self.digest = digest
        self._read = read
        self._cache_folder = os.path.join(cache_folder, INDEX_FOLDER) if cache_folder else None
        self._progress = progress
        self._lock = threading.Lock()
        self._file: object | None = None
        self._chunks: OrderedDict[int, bytes] = OrderedDict()
        self.bound = size * MAX_RATIO + SLACK
        self.warnings: list[str] = []

    # -- the pass

    def scan(self) -> list[Entry]:
        """The tar's members, from the kept index when there is one that matches, else by the one pass; a
        ``TarIndexError`` saying why the layer cannot be read."""
        kept = self._load()
        if kept is not None:
            return kept
        import indexed_gzip

        source = io.BufferedReader(_Counted(self, _RangeFile(lambda lo, n: self._read(self.key, lo, n), self.size)))
        stream = indexed_gzip.IndexedGzipFile(
            fileobj=source, spacing=SPACING, readbuf_size=READ_BUFFER, buffer_size=64 << 10, auto_build=True
        )
        try:
            found = list(entries(stream, self.bound, MAX_ENTRIES, _BOMB))
            raw = stream.detach()  # the _IndexedGzipFile below the buffer: reads keep chunks of their own
        except TarIndexError as exc:
            raise TarIndexError(_said(exc)) from None
        except Exception as exc:  # zran's errors (ZranError, CrcError, …) and the source's
            raise TarIndexError(_said(exc)) from None
        self._file = raw
        self._save(raw, found)
        return found

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

    def _paths(self) -> tuple[str, str] | None:
        if self._cache_folder is None:
            return None
        name = self.digest.replace(":", "-")
        return os.path.join(self._cache_folder, name + ".zran"), os.path.join(self._cache_folder, name + ".json")

    def _load(self) -> list[Entry] | None:
        paths = self._paths()
        if paths is None or not os.path.exists(paths[1]):
            return None
        import indexed_gzip

        index_path, list_path = paths
        try:
            with open(list_path, "rb") as stream:
                kept = json.load(stream)
            with open(index_path, "rb") as stream:
                index = stream.read()
            if (
                kept.get("format") != FORMAT
                or kept.get("size") != self.size
                or kept.get("index_sha256") != hashlib.sha256(index).hexdigest()
            ):
                raise ValueError("it is not the one made for it")
            found = [Entry(str(p), str(k), int(o), int(n), float(t), str(g)) for p, k, o, n, t, g in kept["entries"]]
            source = io.BufferedReader(_RangeFile(lambda lo, n: self._read(self.key, lo, n), self.size))
            file = indexed_gzip._IndexedGzipFile(fileobj=source, spacing=SPACING, readbuf_size=READ_BUFFER)
            file.import_index(fileobj=io.BytesIO(index))
        except Exception as exc:
            self.warnings.append(
                f"{index_path}: the gzip index kept for blob {self.digest} does not match it ({_said(exc)}): made again"
            )
            return None
        self._file = file
        return found

    def _save(self, file: object, found: list[Entry]) -> None:
        paths = self._paths()
        if paths is None:
            return
        index_path, list_path = paths
        try:
            os.makedirs(os.path.dirname(index_path), exist_ok=True)
            buffer = io.BytesIO()
            file.export_index(fileobj=buffer)  # type: ignore[attr-defined]
            index = buffer.getvalue()
            kept = {
                "format": FORMAT,
                "size": self.size,
                "index_sha256": hashlib.sha256(index).hexdigest(),
                "entries": [[e.path, e.kind, e.offset, e.size, e.mtime, e.target] for e in found],
            }
            _write_atomic(index_path, index)
            _write_atomic(list_path, json.dumps(kept, separators=(",", ":")).encode())
        except OSError as exc:
            log.warning("%s: cannot keep the gzip index of %s: %s", index_path, self.digest, exc.strerror or exc)


class _Counted(io.RawIOBase):
    """A raw file passing on its reads and telling the progress bar how many bytes came."""

    def __init__(self, layer: GzipLayer, below: _RangeFile) -> None:
        self._layer = layer
        self._below = below

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._below.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._below.seek(offset, whence)

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        got = self._below.readinto(buffer)
        if self._layer._progress is not None and got:
            self._layer._progress(got)
        return got


def _write_atomic(path: str, data: bytes) -> None:
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as stream:
        stream.write(data)
    os.replace(partial, path)


def _said(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
