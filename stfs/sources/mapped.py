"""A folder of named files, each a byte range of a file of another source: an artifact's layers, a tar's members.

An OCI artifact (a registry's, an OCI image layout's, Ollama's) is a list of blobs; ``MappedFiles`` shows them
as the files they are (``config.json``, ``model.safetensors``, the members of an unpacked tar) to discovery,
the formats and the mount, and reads each from its blob: a ``RemoteFiles`` of the registry, or ``LocalFiles``
of the blobs folder. A file that is a whole blob keeps its source's fast paths: the C side reads it from the
blob's descriptor (local), or from the block cache its source shares (remote).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .base import ByteSource, FileInfo, Kind, SharedBlocks

CHECK_CHUNK = 8 << 20  # bytes of a blob read at once to check its digest


@dataclass(frozen=True, slots=True)
class Piece:
    """Where a named file's bytes are: ``size`` bytes of ``key`` (of the source below) from ``offset``;
    ``whole``: the file is all of ``key``; ``sha256``: its digest where the store names it (a whole blob's)."""

    key: str
    offset: int
    size: int
    whole: bool = False
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class Group:
    """A folder of ``MappedFiles`` holding one artifact: the model it holds is named after the folder, and
    ``metadata`` (the manifest's digest, reference and annotations) joins that model's ``metadata/``, ``warnings``
    its warnings."""

    key: str
    metadata: Mapping[str, str]
    warnings: tuple[str, ...] = ()  # layers left out (compressed), said once for the model
    blobs: tuple[tuple[str, str, int], ...] = ()  # the blobs read: (key below, digest, size), checked by check_blobs
    model_folder: str | None = None  # a container image's /models: its model is looked for there only


class Decoded(Protocol):
    """The decompressed stream of a blob of the source below (a gzip layer's): ``key`` is the blob's."""

    key: str

    def read_at(self, offset: int, count: int) -> bytes: ...

    def close(self) -> None: ...


class MappedFiles:
    """A ``ByteSource`` of named files (``files``: key -> ``Piece``) read from ``below``, or from one of ``decoded``
    where a piece's key is one of those (a compressed layer's members are ranges of its decompressed stream)."""

    def __init__(
        self,
        below: ByteSource,
        files: Mapping[str, Piece],
        groups: list[Group] | None = None,
        named_models: bool = False,
        decoded: Mapping[str, Decoded] | None = None,
    ) -> None:
        self.below = below
        self.decoded = dict(decoded or {})
        # a store whose models keep their folders even alone (Ollama's: the next pull does not move the first model)
        self.named_models = named_models
        self.files = dict(files)
        self.groups = {group.key: group for group in groups or []}
        self.first_read = below.first_read
        self.remote = below.remote
        self.concurrency = below.concurrency
        self._folders: set[str] = set()
        for key in self.files:
            folder = key
            while True:
                folder = folder.rsplit("/", 1)[0]
                if folder in self._folders or "/" not in folder:
                    break
                self._folders.add(folder)
        self._whole_by_blob: dict[str, str] = {}  # a blob's key below -> the one file that is all of it
        for key, piece in sorted(self.files.items()):
            if piece.whole:
                self._whole_by_blob.setdefault(piece.key, key)
        if hasattr(below, "descriptor"):
            self.descriptor = self._descriptor
        if hasattr(below, "share_blocks"):
            self.share_blocks = self._share_blocks
        if hasattr(below, "max_open"):
            self.max_open = below.max_open
        if hasattr(below, "drop_lag"):
            self.drop_lag = below.drop_lag
        self._digests: DigestPass | None = None

    # -- ByteSource

    def kind(self, key: str) -> Kind | None:
        if key in self.files:
            return Kind.FILE
        return Kind.FOLDER if key.rstrip("/") in self._folders else None

    def walk(self, folder: str) -> list[str]:
        prefix = folder.rstrip("/") + "/"
        return sorted(key for key in self.files if key.startswith(prefix))

    def stat(self, key: str) -> FileInfo:
        piece = self._piece(key)
        decoded = self.decoded.get(piece.key)
        info = self.below.stat(decoded.key if decoded is not None else piece.key)
        return FileInfo(key=key, size=piece.size, mtime_ns=info.mtime_ns, version=f"{info.version}@{piece.offset}")

    def read(self, key: str, offset: int, size: int) -> bytes:
        piece = self._piece(key)
        size = min(size, piece.size - offset)
        if size <= 0 or offset < 0:
            return b""
        decoded = self.decoded.get(piece.key)
        if decoded is not None:
            return decoded.read_at(piece.offset + offset, size)
        return self.below.read(piece.key, piece.offset + offset, size)

    def read_into(self, key: str, offset: int, buffer: memoryview, span: tuple[int, int] | None = None) -> int:
        piece = self._piece(key)
        view = buffer if buffer.format == "B" else buffer.cast("B")
        count = max(0, min(len(view), piece.size - offset))
        if count == 0:
            return 0
        decoded = self.decoded.get(piece.key)
        if decoded is not None:
            data = decoded.read_at(piece.offset + offset, count)
            view[: len(data)] = data
            return len(data)
        got = self.below.read_into(piece.key, piece.offset + offset, view[:count], self._span(piece, span))
        if self._digests is not None and got > 0:
            self._digests.saw(piece.key, piece.offset + offset, view[:got])
        return got

    def splice_into(self, key: str, offset: int, count: int, pipe: int, span: tuple[int, int] | None = None) -> int:
        piece = self._piece(key)
        count = max(0, min(count, piece.size - offset))
        if count == 0:
            return 0
        decoded = self.decoded.get(piece.key)
        if decoded is not None:  # decompressed bytes have no pages to lend: written into the pipe
            data = decoded.read_at(piece.offset + offset, count)
            try:
                return os.write(pipe, data)
            except BlockingIOError:
                return 0
        splice = self.below.splice_into  # type: ignore[attr-defined]
        return int(splice(piece.key, piece.offset + offset, count, pipe, self._span(piece, span)))

    def changed(self) -> list[str]:
        changed = set(self.below.changed())
        changed |= {key for key, decoded in self.decoded.items() if decoded.key in changed}
        return sorted(key for key, piece in self.files.items() if piece.key in changed)

    def listed_sha256(self, key: str) -> str | None:
        return self._piece(key).sha256

    @property
    def warnings(self) -> Sequence[str]:
        return self.below.warnings

    def close(self) -> None:
        for decoded in self.decoded.values():
            decoded.close()
        self.below.close()

    def transfer(self) -> dict[str, int]:
        """What went over the wire (a remote source below), as ``RemoteFiles.transfer``."""
        transfer = getattr(self.below, "transfer", None)
        return transfer() if transfer is not None else {"requests": 0, "bytes": 0}

    # -- what a store says of its artifacts

    def may_hold_model(self, key: str) -> bool:
        """Whether discovery may take ``key`` for a model: anywhere, except in a container image that has
        ``/models`` (KServe's modelcars), where only below it."""
        group = self.group_of(key)
        folder = group.model_folder if group is not None else None
        return folder is None or key.startswith(folder + "/")

    def group_of(self, key: str) -> Group | None:
        """The artifact folder that holds ``key``, if any."""
        folder = key
        while "/" in folder:
            folder = folder.rsplit("/", 1)[0]
            if folder in self.groups:
                return self.groups[folder]
        return None

    def hash_as_read(self) -> None:
        """From now on, take each blob's digest from the bytes reads bring (``DigestPass``): ``check_blobs`` then
        reads only what no read did, so ``check --values`` fetches a blob once, not once for the values and again for
        the digest."""
        blobs = {key: digest for group in self.groups.values() for key, digest, _ in group.blobs}
        self._digests = DigestPass(self.below, blobs)

    def check_blobs(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Read every blob the groups name and compare it with its digest (a blob is content addressed); one line
        for each that differs or cannot be read. Bytes of it already hashed (``hash_as_read``) are not read again."""
        problems = []
        for group in self.groups.values():
            for key, digest, size in group.blobs:
                taken = self._digests.taken(key) if self._digests is not None else None
                hasher, offset = taken if taken is not None else (hashlib.new(digest.partition(":")[0]), 0)
                try:
                    hash_range(self.below, key, offset, size, hasher, progress)
                except OSError as exc:
                    problems.append(f"{group.key}: blob {digest}: cannot read: {exc.strerror or exc}")
                    continue
                if hasher.hexdigest() != digest.partition(":")[2]:
                    problems.append(
                        f"{group.key}: blob {digest} holds other bytes (their sha256 is {hasher.hexdigest()})"
                    )
        return problems

    # -- fast paths of the source below, for files that are whole blobs

    def _descriptor(self, key: str) -> tuple[int, int, int] | None:
        piece = self.files.get(key)
        if piece is None or not piece.whole:
            return None  # a tar member: its offsets are not the blob's, Python reads it
        return self.below.descriptor(piece.key)  # type: ignore[attr-defined]

    def _share_blocks(self, shared: SharedBlocks) -> tuple[int, int, int]:
        return self.below.share_blocks(_Renamed(shared, self._whole_by_blob))  # type: ignore[attr-defined]

    # --

    def _piece(self, key: str) -> Piece:
        piece = self.files.get(key)
        if piece is None:
            raise FileNotFoundError(key)
        return piece

    @staticmethod
    def _span(piece: Piece, span: tuple[int, int] | None) -> tuple[int, int]:
        low, high = span if span is not None else (0, piece.size)
        return piece.offset + low, piece.offset + min(high, piece.size)


class DigestPass:
    """The digests of blobs taken from the bytes reads bring, each byte hashed once and in order: a read past where
    a blob's hash has come first reads the gap (a header, integer tensors) from the source below, a read of bytes
    already hashed adds nothing. A blob whose gap cannot be read is left to ``check_blobs``, which reads it whole and
    says why."""

    def __init__(self, below: ByteSource, blobs: Mapping[str, str]) -> None:
        self.below = below
        self._hashes = {key: (hashlib.new(digest.partition(":")[0]), [0]) for key, digest in blobs.items()}

    def saw(self, key: str, offset: int, data: memoryview) -> None:
        """Reads brought ``data``, the bytes of blob ``key`` from ``offset``."""
        hashing = self._hashes.get(key)
        if hashing is None:
            return
        hasher, position = hashing
        if offset > position[0]:
            try:
                hash_range(self.below, key, position[0], offset, hasher)
            except OSError:
                del self._hashes[key]
                return
            position[0] = offset
        if offset <= position[0] < offset + len(data):
            hasher.update(data[position[0] - offset :])
            position[0] = offset + len(data)

    def taken(self, key: str) -> tuple[Any, int] | None:
        """The hash of blob ``key`` so far and the offset it has come to (``None``: none)."""
        hashing = self._hashes.get(key)
        return (hashing[0], hashing[1][0]) if hashing is not None else None


def hash_range(
    source: ByteSource, key: str, start: int, end: int, hasher: Any, progress: Callable[[int], None] | None = None
) -> None:
    """Add bytes ``[start, end)`` of ``key`` to ``hasher``, read ``CHECK_CHUNK`` at a time (an ``OSError`` where they
    cannot be read); each chunk's length told to ``progress``."""
    buffer = memoryview(bytearray(min(end - start, CHECK_CHUNK) or 1))
    offset = start
    while offset < end:
        got = source.read_into(key, offset, buffer[: min(len(buffer), end - offset)])
        if got <= 0:
            raise OSError(f"it ends at byte {offset}")
        hasher.update(buffer[:got])
        offset += got
        if progress is not None:
            progress(got)


class _Renamed:
    """A remote source's published blocks passed on under the name of the file that is their whole blob."""

    def __init__(self, shared: SharedBlocks, names: dict[str, str]) -> None:
        self._shared = shared
        self._names = names

    def publish(self, slot: int, key: str, block: int, lo: int, hi: int) -> None:
        name = self._names.get(key)
        if name is not None:
            self._shared.publish(slot, name, block, lo, hi)

    def withdraw(self, slot: int) -> bool:
        return self._shared.withdraw(slot)

    def changed(self, key: str) -> None:
        name = self._names.get(key)
        if name is not None:
            self._shared.changed(name)
