"""The members of an artifact's tar layers, wherever their bytes are: an uncompressed tar's headers read by Range
(``tar_index``), a compressed tar's after its one pass (``gzip_layer``, ``zstd_layer``); and the files an
artifact's layers make, a container image's applied in order (``image``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import errors
from ..progress import ByteProgress, shown
from .base import ByteSource, join_key
from .compressed_layer import CompressedLayer
from .disk_cache import DiskCache
from .gzip_layer import GzipLayer
from .image import ImageError, image_files
from .mapped import Piece
from .oci_artifact import Artifact, Layer, member_path
from .tar_index import MAX_MEMBERS, Entry, TarIndexError, _RangeFile, entries
from .zstd_layer import ZstdLayer

log = logging.getLogger(__name__)

WARNINGS = 20  # lines said for the members an image leaves out; the rest counted in one

# A compressed layer's members are pieces of KEY#COMPRESSION: the decompressed stream of the blob KEY.
DECODERS: dict[str, type[CompressedLayer]] = {"gzip": GzipLayer, "zstd": ZstdLayer}


class Unpacker:
    """Reads the layers of the artifacts of one source (``blob_key(digest)`` a blob's key there): a tar's headers
    with ``read`` (one request each), a gzip layer's bytes through ``read_into`` (its block cache and readahead);
    what their passes find kept in ``disk`` (``--cache-dir``) when there is one. ``decoded`` holds the compressed
    layers read (by the key their members' pieces name), ``warnings`` what was left out."""

    def __init__(self, source: ByteSource, blob_key: Callable[[str], str], disk: DiskCache | None) -> None:
        self.source = source
        self.read = source.read
        self.blob_key = blob_key
        self.disk = disk
        self.decoded: dict[str, CompressedLayer] = {}
        self.model_folders: dict[str, str] = {}  # an image's root -> its /models: where its model is looked for
        self.warnings: list[str] = []

    def entries(self, layer: Layer, where: str) -> tuple[list[Entry], str]:
        """The members of the tar ``layer`` is, and the key their file pieces name."""
        key = self.blob_key(layer.digest)
        try:
            if layer.compression in DECODERS:
                return self._decompressed(layer, key), key + "#" + layer.compression
            import io

            stream = io.BufferedReader(_RangeFile(lambda lo, n: self.read(key, lo, n), layer.size))
            return list(entries(stream, layer.size, MAX_MEMBERS)), key
        except TarIndexError as exc:
            raise errors.SourceError(f"{where}: layer {layer.digest} is not a tar stfs can read ({exc})") from None
        except OSError as exc:
            raise errors.SourceError(f"{where}: layer {layer.digest}: cannot read: {exc.strerror or exc}") from None

    def _decompressed(self, layer: Layer, key: str) -> list[Entry]:
        bar = ByteProgress(layer.size, f"indexing {layer.compression} layer {layer.digest[7:19]}", shown())
        decoder = DECODERS[layer.compression]
        stream = decoder(self._read_cached, key, layer.size, layer.digest, self.disk, bar.update)
        try:
            found = stream.scan()
        except BaseException:
            stream.close()
            raise
        finally:
            bar.close()
        self.warnings += stream.warnings  # said with the model's warnings
        self.decoded[key + "#" + layer.compression] = stream
        return found

    def _read_cached(self, key: str, offset: int, count: int) -> bytes:
        buffer = bytearray(count)
        got = self.source.read_into(key, offset, memoryview(buffer))
        return bytes(buffer[:got]) if got < count else bytes(buffer)

    def close(self) -> None:
        for layer in self.decoded.values():
            layer.close()

    def files(self, artifact: Artifact, root: str, where: str) -> dict[str, Piece]:
        """The files of ``artifact`` as keys below ``root``: each layer a file, an unpacked tar's members each one,
        an image's layers one tree; a ``SourceError`` where two take one path."""
        files: dict[str, Piece] = {}
        origin: dict[str, str] = {}
        image = [layer for layer in artifact.layers if layer.image]
        if image:
            try:
                tree, models = image_files(
                    ((layer.digest, *self._piece_maker(layer, where)) for layer in image), warn := _Warnings(where)
                )
            except ImageError as exc:
                raise errors.SourceError(f"{where}: the image is not one stfs can show ({exc})") from None
            if models is not None:
                self.model_folders[root] = join_key(root, models)
            self.warnings += warn.lines
            if warn.more:
                self.warnings.append(f"{where}: {warn.more} more members or links left out likewise")
            for path, piece in tree.items():
                origin[path] = "the image"
                files[join_key(root, path)] = piece
        for layer in artifact.layers:
            if layer.image:
                continue
            key = self.blob_key(layer.digest)
            if not layer.unpack:
                placed = [(layer.name, Piece(key, 0, layer.size, whole=True, sha256=layer.digest.partition(":")[2]))]
            else:
                found, below = self.entries(layer, where)
                placed = []
                for member in found:
                    if member.kind != "file":
                        continue
                    inside = member_path(layer, member.path)
                    if inside is None:
                        log.warning(
                            "%s: layer %s: member %r is outside the model: left out", where, layer.digest, member
                        )
                        continue
                    placed.append((inside, Piece(below, member.offset, member.size)))
            for path, piece in placed:
                if path in origin:
                    raise errors.SourceError(
                        f"{where}: {path!r} is in both layer {origin[path]} and layer {layer.digest}"
                    )
                origin[path] = layer.digest
                files[join_key(root, path)] = piece
        folders = {key.rsplit("/", 1)[0] for key in files}
        for key in files:
            if key in folders:
                raise errors.SourceError(
                    f"{where}: {key[len(root) + 1 :]!r} is both a file and a folder of the artifact"
                )
        return files

    def _piece_maker(self, layer: Layer, where: str) -> tuple[list[Entry], Callable[[Entry], Piece]]:
        found, below = self.entries(layer, where)
        return found, lambda entry: Piece(below, entry.offset, entry.size)


class _Warnings:
    """The warnings of ``where``: the first ``WARNINGS`` said, the rest counted (a hostile layer could have a
    million)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.lines: list[str] = []
        self.more = 0

    def __call__(self, text: str) -> None:
        if len(self.lines) < WARNINGS:
            self.lines.append(f"{self.where}: {text}")
        else:
            self.more += 1
