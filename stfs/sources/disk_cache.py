"""Fetched ranges of remote files kept on disk across mounts (``--cache-dir``), within a bound (``--cache-dir-size``).

A piece is a file ``DIR/<hash of key and version>/<lo>-<hi>`` holding bytes ``[lo, hi)`` of one version of an
object: every range a mount fetched, whatever its size (a tensor clipped out of a block, a whole block). Keyed by
object *and* version, so a changed object never hits an old piece. A read takes what the pieces of its object
cover (the fewest pieces that do, as rclone's VFS cache keeps a map of the ranges it holds per object) and fetches
only the gaps. Pieces are written to a temporary name and renamed into place, so two daemons sharing DIR never
see half a piece; a piece whose size is not what its name says is ignored.

The bound holds across every daemon that shares DIR, through one small file, ``DIR/.stfs-usage``: the bytes
of pieces DIR holds, read and written under an exclusive ``flock`` of it. A daemon that would take DIR past
the bound first deletes the least recently used pieces (a piece's mtime is set each time one is read), never
one that a daemon is reading: a reader holds a shared ``flock`` of the piece while it reads, and a piece is
deleted only under an exclusive one, taken without waiting. Each daemon writes one piece at a time, so DIR
holds at most the bound plus one piece being written per daemon. A full disk (ENOSPC) stops the writing, with
one log line; reads go on from memory and from the pieces already kept.

What a compressed layer keeps by its blob's digest (a gzip seek index, a zstd frame index, a zstd layer's output
kept whole) is a *file* ``DIR/<folder>/<name>``, asked of this class by name (``open_file``, ``write_file``,
``begin_file``/``keep_file``): counted in the same usage and deleted least recently used first with the pieces.
A daemon holds a shared ``flock`` of such a file for as long as it has it open (a zstd output: the mount's life),
so none is deleted under a daemon using it; one deleted is made again by the next mount that needs it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import BinaryIO

from cachetools import LRUCache

from .. import errors

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 10 << 30
USAGE_FILE = ".stfs-usage"
STALE_TEMPORARY = 600.0  # seconds: a temporary piece this old was left by a daemon that died writing it
PIECE_NAME = re.compile(r"(\d+)-(\d+)")
# A folder's mtime may not move for a change made within the same clock tick as a listing of it: a listing is
# trusted only while the folder's mtime is this much older than the listing (as git trusts its index).
MTIME_GRANULARITY_NS = 20_000_000
LISTINGS = 4096  # objects whose listing of pieces a daemon keeps in memory

Range = tuple[int, int]


def open_disk_cache(folder: str | None, max_bytes: int | None) -> DiskCache | None:
    """The cache ``--cache-dir`` names (``None`` without one), bounded by ``--cache-dir-size``; a ``SourceError``
    where it cannot be kept there."""
    if not folder:
        return None
    try:
        return DiskCache(folder, max_bytes or DEFAULT_MAX_BYTES)
    except OSError as exc:
        raise errors.SourceError(f"{folder}: cannot keep a cache there: {exc.strerror or exc}") from None


class DiskCache:
    """Pieces ``[lo, hi)`` of versioned objects under ``folder``, at most ``max_bytes`` of them."""

    def __init__(self, folder: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder = os.path.abspath(folder)
        self.max_bytes = max_bytes
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self.folder)
        os.makedirs(self.folder, exist_ok=True)
        os.close(os.open(os.path.join(self.folder, USAGE_FILE), os.O_RDWR | os.O_CREAT, 0o600))  # writable here?
        self._writing = threading.Lock()  # one piece at a time from this daemon (flock does not exclude threads)
        self.full = False  # the disk was full: no more pieces are written
        self._listings: LRUCache[str, tuple[int, int, list[Range]]] = LRUCache(LISTINGS)
        self._listings_lock = threading.Lock()

    def _object(self, key: str, version: str) -> str:
        digest = hashlib.sha256(f"{key}\0{version}".encode("utf-8", "surrogateescape")).hexdigest()[:40]
        return os.path.join(self.folder, digest)

    def _path(self, key: str, version: str, lo: int, hi: int) -> str:
        return os.path.join(self._object(key, version), f"{lo}-{hi}")

    def kept(self, key: str, version: str) -> list[Range]:
        """The pieces of ``key`` at ``version`` that DIR holds, as ``(lo, hi)``, sorted."""
        return list(self._listing(self._object(key, version))) if version else []

    def read_into(self, key: str, version: str, lo: int, into: memoryview) -> list[Range]:
        """Fill what the kept pieces cover of ``into`` (bytes ``[lo, lo + len(into))`` of ``key`` at ``version``);
        the ranges filled, sorted and merged. The pieces read become the most recently used."""
        if not version:
            return []  # without a version a piece could be of any version: never kept, never used
        folder = self._object(key, version)
        filled: list[Range] = []
        for piece_lo, piece_hi, start, end in covering(self._listing(folder), lo, lo + len(into)):
            path = os.path.join(folder, f"{piece_lo}-{piece_hi}")
            if _read_piece(path, piece_hi - piece_lo, start - piece_lo, into[start - lo : end - lo]):
                if filled and filled[-1][1] == start:
                    filled[-1] = (filled[-1][0], end)
                else:
                    filled.append((start, end))
            else:  # evicted meanwhile, or not what its name says: list the folder again next time
                with self._listings_lock:
                    self._listings.pop(folder, None)
        return filled

    def get(self, key: str, version: str, lo: int, hi: int) -> bytes | None:
        """Bytes ``[lo, hi)`` of ``key`` at ``version`` if kept pieces cover them all, else ``None``."""
        into = memoryview(bytearray(hi - lo))
        return bytes(into) if self.read_into(key, version, lo, into) == [(lo, hi)] else None

    def _listing(self, folder: str) -> list[Range]:
        """The pieces in an object's folder, sorted; listed again only when the folder has changed."""
        try:
            changed = os.stat(folder).st_mtime_ns
        except OSError:
            return []
        with self._listings_lock:
            known = self._listings.get(folder)
        if known is not None and known[0] == changed and changed < known[1] - MTIME_GRANULARITY_NS:
            return known[2]
        listed_at = time.time_ns()
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        pieces = sorted((int(m[1]), int(m[2])) for m in map(PIECE_NAME.fullmatch, names) if m and int(m[1]) < int(m[2]))
        with self._listings_lock:
            self._listings[folder] = (changed, listed_at, pieces)
        return pieces

    def put(self, key: str, version: str, lo: int, hi: int, data: bytes | memoryview) -> None:
        """Keep bytes ``[lo, hi)`` as a piece (unless kept pieces cover them already), making room for it;
        failures (a full disk) are logged, never raised: the cache is an optimisation."""
        if not version or self.full or len(data) > self.max_bytes or lo >= hi:
            return
        path = self._path(key, version, lo, hi)
        with self._writing:
            if self.full:  # found full by a put that held the lock meanwhile: one log line, not one per put
                return
            temporary = _temporary(path)
            try:
                if _covers(self._listing(os.path.dirname(path)), lo, hi):
                    return
                self._write(temporary, data)
                self._place(temporary, path, len(data))
            except OSError as exc:
                self._failed(key, exc)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def _place(self, temporary: str, path: str, size: int) -> None:
        """Rename the written ``temporary`` piece to ``path``, counted in the usage, room made for it first."""
        with self._usage() as usage:
            total = usage.read()
            if os.path.exists(path):  # another daemon kept it meanwhile
                return
            if total + size > self.max_bytes:
                total = self._evict(self.max_bytes - size)
            os.replace(temporary, path)
            usage.write(total + size)

    def _failed(self, key: str, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.full = True
            log.warning("%s is full: fetched blocks are kept in memory only from now on (%s)", self.folder, exc)
        else:
            log.warning("cannot keep a piece of %s in %s: %s", key, self.folder, exc)

    def open_piece(self, key: str, version: str, lo: int, hi: int) -> int | None:
        """A descriptor (read-only) of the kept piece ``[lo, hi)`` of ``key`` at ``version``, made the most recently
        used; ``None`` if DIR holds no such piece."""
        if not version:
            return None
        try:
            fd = os.open(self._path(key, version, lo, hi), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if os.fstat(fd).st_size != hi - lo:
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            os.utime(fd)
        return fd

    def begin_piece(self, key: str, version: str, lo: int, hi: int) -> tuple[int, str]:
        """A new temporary piece ``[lo, hi)`` of ``key`` at ``version`` to write in place (and read as it is written):
        its descriptor and its name, to give ``keep_piece`` once written; without a version, a file with no name in
        DIR, gone when closed (a piece could be of any version: never kept), and name ``""``."""
        if not version:
            try:
                return os.open(self.folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), ""
            except OSError:  # a filesystem without O_TMPFILE: a name, unlinked at once
                temporary = os.path.join(self.folder, f".{os.getpid()}.{threading.get_ident()}.{time.time_ns()}.tmp")
                fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                os.unlink(temporary)
                return fd, ""
        temporary = _temporary(self._path(key, version, lo, hi))
        return _created(temporary), temporary

    def keep_piece(self, key: str, version: str, lo: int, hi: int, temporary: str) -> None:
        """Keep the ``temporary`` piece from ``begin_piece``, written, as ``[lo, hi)`` (room made for it, counted);
        failures are logged, never raised."""
        path = self._path(key, version, lo, hi)
        with self._writing:
            try:
                self._place(temporary, path, hi - lo)
            except OSError as exc:
                self._failed(key, exc)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    @staticmethod
    def _write(temporary: str, data: bytes | memoryview) -> None:
        with open(_created(temporary), "wb") as stream:
            stream.write(data)

    # -- files kept by name: a layer's index or output

    def open_file(self, name: str) -> BinaryIO | None:
        """The file kept as ``name`` (``FOLDER/FILE``), open to read and made the most recently used, a shared lock
        held on it until it is closed (no daemon deletes it meanwhile); ``None`` if DIR holds none."""
        try:
            file = open(os.path.join(self.folder, name), "rb")  # noqa: SIM115
        except OSError:
            return None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_SH)
            if os.fstat(file.fileno()).st_nlink == 0:  # deleted between the open and the lock
                raise FileNotFoundError(name)
            with contextlib.suppress(OSError):
                os.utime(file.fileno())
        except OSError:
            file.close()
            return None
        return file

    def begin_file(self, name: str) -> tuple[BinaryIO, str]:
        """A new temporary file to write as ``name``, open to write and read, a shared lock held on it while open;
        and its path, to give ``keep_file`` once written."""
        temporary = _temporary(os.path.join(self.folder, name))
        file = open(_created(temporary), "w+b")  # noqa: SIM115
        fcntl.flock(file.fileno(), fcntl.LOCK_SH)
        return file, temporary

    def keep_file(self, name: str, file: BinaryIO, temporary: str) -> bool:
        """Keep the written ``temporary`` of ``begin_file`` as ``name`` (room made for it, counted), ``file`` open
        and locked as that from now on; whether it is kept (not past the bound; failures logged, never raised)."""
        with self._writing:
            try:
                file.flush()
                size = os.fstat(file.fileno()).st_size
                if self.full or size > self.max_bytes:
                    return False
                self._place(temporary, os.path.join(self.folder, name), size)
                return True
            except OSError as exc:
                self._failed(name, exc)
                return False
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def write_file(self, name: str, data: bytes) -> None:
        """Keep ``data`` as the file ``name`` (room made for it, counted); failures logged, never raised."""
        try:
            file, temporary = self.begin_file(name)
        except OSError as exc:
            self._failed(name, exc)
            return
        with file:
            try:
                file.write(data)
            except OSError as exc:
                self._failed(name, exc)
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                return
            self.keep_file(name, file, temporary)

    def drop_file(self, name: str) -> None:
        """Delete the file kept as ``name`` (found spoiled), uncounted, unless a daemon has it open."""
        path = os.path.join(self.folder, name)
        with self._writing, self._usage() as usage:
            try:
                size = os.stat(path).st_size
            except OSError:
                return
            if _delete(path):
                usage.write(max(usage.read() - size, 0))

    def usage(self) -> int:
        """The bytes of pieces DIR holds, as the daemons sharing it count them."""
        with self._usage() as usage:
            return usage.read()

    @contextlib.contextmanager
    def _usage(self) -> Iterator[_Usage]:
        """The shared count, held under an exclusive lock for the ``with`` block."""
        fd = os.open(os.path.join(self.folder, USAGE_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            usage = _Usage(fd)
            if usage.read() < 0:  # a new folder, or one kept before the count existed: count it once
                usage.write(sum(size for _, size, _ in self._pieces()))
            yield usage
        finally:
            os.close(fd)  # releases the lock

    def _evict(self, target: int) -> int:
        """Delete the least recently used pieces until at most ``target`` bytes are kept; the bytes kept.

        Called under the usage lock. A piece a daemon is reading (its shared lock held) is skipped."""
        pieces = sorted(self._pieces())
        total = sum(size for _, size, _ in pieces)
        for _, size, path in pieces:
            if total <= target:
                break
            if _delete(path):
                total -= size
        return max(total, 0)

    def _pieces(self) -> Iterator[tuple[float, int, str]]:
        """(mtime, size, path) of every piece kept; temporary pieces left by a dead daemon are deleted."""
        now = time.time()
        with os.scandir(self.folder) as objects:
            for entry in objects:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError), os.scandir(entry.path) as pieces:
                    for piece in pieces:
                        with contextlib.suppress(OSError):
                            info = piece.stat(follow_symlinks=False)
                            if piece.name.endswith(".tmp"):
                                if now - info.st_mtime > STALE_TEMPORARY:
                                    os.unlink(piece.path)
                                continue
                            yield info.st_mtime, info.st_size, piece.path


class _Usage:
    """The count in ``DIR/.stfs-usage``: decimal bytes; ``-1`` when there is none yet."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self) -> int:
        text = os.pread(self.fd, 32, 0).strip()
        return int(text) if text.isdigit() else -1

    def write(self, total: int) -> None:
        data = f"{total}\n".encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))


def covering(pieces: list[Range], lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """The fewest of ``pieces`` (sorted) that cover what they can of ``[lo, hi)``: ``(piece_lo, piece_hi, start,
    end)``, each used for ``[start, end)``, in order; what none covers is left out (a gap to fetch)."""
    chosen: list[tuple[int, int, int, int]] = []
    best: Range | None = None  # of the pieces starting at or before ``position``, the one reaching furthest
    position, index = lo, 0
    while position < hi:
        while index < len(pieces) and pieces[index][0] <= position:
            if best is None or pieces[index][1] > best[1]:
                best = pieces[index]
            index += 1
        if best is None or best[1] <= position:  # a gap: on to the next piece that starts inside the range
            if index >= len(pieces) or pieces[index][0] >= hi:
                break
            position = pieces[index][0]
            continue
        end = min(best[1], hi)
        chosen.append((best[0], best[1], position, end))
        position = end
    return chosen


def gaps(lo: int, hi: int, filled: list[Range], bridge: int = 0) -> list[Range]:
    """The parts of ``[lo, hi)`` outside ``filled`` (sorted, disjoint); gaps less than ``bridge`` bytes apart are one
    (one request for both is cheaper than two, the bytes between fetched again)."""
    found: list[Range] = []
    position = lo
    for a, b in filled:
        if a > position:
            found.append((position, min(a, hi)))
        position = max(position, b)
        if position >= hi:
            break
    if position < hi:
        found.append((position, hi))
    merged: list[Range] = []
    for a, b in found:
        if merged and a - merged[-1][1] < bridge:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def _covers(pieces: list[Range], lo: int, hi: int) -> bool:
    return not gaps(lo, hi, [(start, end) for _, _, start, end in covering(pieces, lo, hi)])


def _delete(path: str) -> bool:
    """Delete the piece or file at ``path`` unless a daemon holds a lock of it (reads it); whether it is gone. Its
    folder goes too when it was the last one there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:  # BlockingIOError: being read right now, not this one
        return False
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))
    return True


def _temporary(path: str) -> str:
    """The name a piece or file is written under before it is renamed to ``path`` (``.tmp``: never counted)."""
    return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"


def _created(temporary: str) -> int:
    """A descriptor of the new (emptied) file ``temporary``, open to write and read, its folder made."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    os.makedirs(os.path.dirname(temporary), exist_ok=True)
    try:
        return os.open(temporary, flags, 0o600)
    except FileNotFoundError:  # another daemon evicted the folder's last piece, and the folder, just now: again
        os.makedirs(os.path.dirname(temporary), exist_ok=True)
        return os.open(temporary, flags, 0o600)


def _read_piece(path: str, size: int, offset: int, into: memoryview) -> bool:
    """Fill ``into`` from ``offset`` of the piece at ``path``, whose size must be ``size``; whether it did."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # not deleted while read (an evictor's LOCK_EX fails)
        if os.fstat(fd).st_size != size:
            return False
        done = 0
        while done < len(into):
            count = os.preadv(fd, [into[done:]], offset + done)
            if count <= 0:
                return False
            done += count
        with contextlib.suppress(OSError):
            os.utime(fd)  # least recently used goes first: this one was just used
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
