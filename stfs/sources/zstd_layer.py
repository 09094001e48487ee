"""A zstd'd tar layer (SPEC §14a): read at random by its frames, or read whole once when it is one large frame.

One pass streams the blob from its start (through the source below: block cache, readahead) and decompresses it
frame by frame, noting where each frame starts in the blob and in the output, while the tar's members are listed.
A layer of frames no larger than ``FRAME_MAX`` of output (zstd:chunked, the seekable format) is then read by
frame: a read decompresses the frames it covers, the last few kept; with ``--cache-dir`` the frames and the members
are kept there by the blob's digest (``layer_index``), so a later mount makes no pass. A layer with a larger frame
(what ``zstd`` and most tools write: one frame) cannot be entered in the middle, so its output is kept whole from
the pass, once that meets such a frame: in ``--cache-dir`` (by the blob's digest, kept for later mounts, held open
while mounted) up to ``--cache-dir-size``, or in memory up to ``MEMORY_MAX``; past that it is refused in one line
naming the option.
Both are ``DiskCache`` files: counted in ``--cache-dir-size``, the least recently used deleted first.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import os
from collections import OrderedDict
from typing import Any, BinaryIO

from . import layer_index
from .compressed_layer import CompressedLayer
from .gzip_layer import MAX_RATIO, SLACK
from .tar_index import MAX_MEMBERS, Entry, TarIndexError, entries

FRAME_MAX = 16 << 20  # frames up to this much output are read one by one; a larger one makes the layer read whole
MEMORY_MAX = 256 << 20  # output kept in memory at most (a layer read whole without --cache-dir)
FRAMES_KEPT = 4
READ = 1 << 20
FOLDER = "zstd-whole"
INDEX_FOLDER = "zstd-index"
Frame = tuple[int, int, int, int]  # (output start, output end, blob start, blob end)


class ZstdLayer(CompressedLayer):
    """The decompressed stream of the zstd blob ``key`` (``size`` bytes) that ``read(key, offset, count)`` reads;
    ``scan()`` makes the pass and gives the tar's members, ``read_at`` its bytes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._whole_name = layer_index.kept_name(FOLDER, self.digest, ".tar")
        self._index_name = layer_index.kept_name(INDEX_FOLDER, self.digest, ".index")
        self._frames: list[Frame] = []
        self._starts: list[int] = []
        self._kept: OrderedDict[int, bytes] = OrderedDict()
        self._whole: BinaryIO | None = None

    def scan(self) -> list[Entry]:
        import zstandard

        if self._disk is not None:
            kept = self._reuse_frames()
            if kept is None:
                kept = self._reuse_whole()
            if kept is not None:
                return kept
        spool, temporary = self._disk.begin_file(self._whole_name) if self._disk else (io.BytesIO(), "")
        limit = self._disk.max_bytes if self._disk else MEMORY_MAX
        stream = _Pass(self, zstandard, spool, limit)
        try:
            found = list(
                entries(io.BufferedReader(stream), self.size * MAX_RATIO + SLACK, MAX_MEMBERS, "the layer's bound")
            )
            stream.finish()
        except Exception as exc:  # the tar's, zstd's and the source's
            _discard(spool, temporary)
            if isinstance(exc, TarIndexError):
                raise
            raise TarIndexError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        self._set_frames(stream.frames)
        if max((end - start for start, end, _, _ in self._frames), default=0) <= FRAME_MAX:
            _discard(spool, temporary)
            if self._disk is not None:
                layer_index.save(self._disk, self._index_name, self.size, found, {"frames": self._frames})
            return found
        if stream.spool_full:
            _discard(spool, temporary)
            room = "--cache-dir-size" if self._disk else "memory"
            advice = (
                "mount with a larger --cache-dir-size" if self._disk else "mount with --cache-dir DIR to keep it there"
            )
            raise TarIndexError(
                f"it is one zstd frame of more than {FRAME_MAX >> 20} MiB, which cannot be read at random, and its "
                f"{stream.out >> 20} MiB do not fit in {room} ({limit >> 20} MiB): {advice}"
            )
        if self._disk is not None:  # kept under the blob's digest for the next mount; read here while open
            self._disk.keep_file(self._whole_name, spool, temporary)
        self._whole = spool
        return found

    def _set_frames(self, frames: list[Frame]) -> None:
        self._frames = frames
        self._starts = [frame[0] for frame in frames]

    def _reuse_frames(self) -> list[Entry] | None:
        """The members of a layer of frames whose index a mount before kept in ``--cache-dir`` (its frames read from
        now on); ``None`` where none is kept, or (said in one line) where the one kept does not fit the blob."""
        assert self._disk is not None
        try:
            kept = layer_index.load(self._disk, self._index_name, self.size)
            if kept is None:
                return None
            found, head, _ = kept
            frames = [(int(a), int(b), int(c), int(d)) for a, b, c, d in head["frames"]]
            _check_frames(frames, self.size)
        except (ValueError, TypeError, KeyError) as exc:
            self._disk.drop_file(self._index_name)
            self.warnings.append(
                f"{os.path.join(self._disk.folder, self._index_name)}: the zstd frame index kept for blob "
                f"{self.digest} does not match it ({exc}): made again"
            )
            return None
        self._set_frames(frames)
        return found

    def _reuse_whole(self) -> list[Entry] | None:
        """The members of the output a mount before kept whole in ``--cache-dir`` (read there from now on, held open);
        ``None`` where none is kept, or (said in one line) where it is not a whole tar."""
        assert self._disk is not None
        file = self._disk.open_file(self._whole_name)
        if file is None:
            return None
        try:
            size = os.fstat(file.fileno()).st_size
            found = list(entries(io.BufferedReader(io.FileIO(file.fileno(), closefd=False)), size, MAX_MEMBERS))
        except (OSError, TarIndexError) as exc:
            file.close()
            self._disk.drop_file(self._whole_name)
            self.warnings.append(
                f"{os.path.join(self._disk.folder, self._whole_name)}: the output kept for blob {self.digest} is not "
                f"a whole tar ({exc}): made again"
            )
            return None
        self._whole = file
        return found

    def read_at(self, offset: int, count: int) -> bytes:
        if self._whole is not None:
            with self._lock:
                self._whole.seek(offset)
                return self._whole.read(count)
        parts = []
        end = offset + count
        while offset < end:
            number = bisect.bisect_right(self._starts, offset) - 1
            if number < 0:
                break
            start = self._frames[number][0]
            data = self._frame(number)
            piece = data[offset - start : end - start]
            if not piece:
                break
            parts.append(piece)
            offset += len(piece)
        return b"".join(parts)

    def _frame(self, number: int) -> bytes:
        with self._lock:
            data = self._kept.get(number)
            if data is not None:
                self._kept.move_to_end(number)
                return data
        data = self.inflate(self._frames[number])
        with self._lock:
            self._kept[number] = data
            if len(self._kept) > FRAMES_KEPT:
                self._kept.popitem(last=False)
        return data

    def inflate(self, frame: Frame) -> bytes:
        """The output of ``frame``, its bytes read from the blob and decompressed."""
        import zstandard

        start, end, lo, hi = frame
        try:
            return zstandard.ZstdDecompressor().decompress(
                self._read(self.key, lo, hi - lo), max_output_size=end - start
            )
        except zstandard.ZstdError as exc:
            raise OSError(f"{self.digest}: cannot decompress: {exc}") from None

    def close(self) -> None:
        if self._whole is not None:
            self._whole.close()
            self._whole = None


def _check_frames(frames: list[Frame], size: int) -> None:
    """A ``ValueError`` unless ``frames`` follow one another from the start of the output and of the blob of ``size``
    bytes to its end, each no larger than ``FRAME_MAX`` of output."""
    out = blob = 0
    for start, end, lo, hi in frames:
        if start != out or lo != blob or not start <= end <= start + FRAME_MAX or lo >= hi:
            raise ValueError(f"its frame at byte {lo} does not follow the one before")
        out, blob = end, hi
    if blob != size:
        raise ValueError(f"its frames end at byte {blob} of the blob's {size}")


def _discard(spool: BinaryIO, temporary: str) -> None:
    """Close the output spooled, deleting it from ``--cache-dir`` where it was written there."""
    spool.close()
    if temporary:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


class _Pass(io.RawIOBase):
    """The decompressed stream, read front to back (forward seeks decompress and skip): frames noted, and output
    spooled once it is known to be needed whole: from the first frame that grows past ``FRAME_MAX`` (the frames
    before it decompressed again into the spool then). A layer of small frames writes nothing there."""

    def __init__(self, layer: ZstdLayer, zstandard: object, spool: BinaryIO, limit: int) -> None:
        self._layer = layer
        self._zstd = zstandard
        self._spool = spool
        self._in = 0  # blob bytes read
        self._frame_in = 0  # where the current frame starts in the blob
        self._frame_out = 0
        self._decoder = zstandard.ZstdDecompressor().decompressobj()  # type: ignore[attr-defined]
        self._buffer = b""
        self._at = 0  # bytes of _buffer already given
        self._position = 0
        self.out = 0  # output made
        self.frames: list[tuple[int, int, int, int]] = []
        self._pending: list[bytes] = []  # the current frame's output while no frame is past FRAME_MAX: not spooled
        self._spooling = False
        self.spool_full = False
        self._limit = limit  # output spooled at most: past it, the layer cannot be read whole

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else self._position + offset
        if target < self._position:
            raise OSError("the pass reads forward only")
        while self._position < target:
            if not self._more():
                break
            take = min(len(self._buffer) - self._at, target - self._position)
            self._at += take
            self._position += take
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        if not self._more():
            return 0
        take = min(len(view), len(self._buffer) - self._at)
        view[:take] = self._buffer[self._at : self._at + take]
        self._at += take
        self._position += take
        return take

    def _more(self) -> bool:
        """Decompress until output is buffered; ``False`` at the blob's end."""
        if self._at >= len(self._buffer):
            self._buffer, self._at = b"", 0
        while not self._buffer:
            if self._in >= self._layer.size:
                return False
            data = self._layer._read(self._layer.key, self._in, min(READ, self._layer.size - self._in))
            if not data:
                raise OSError(f"the blob ends at byte {self._in}")
            if self._layer._progress is not None:
                self._layer._progress(len(data))
            self._feed(data)
        return True

    def _feed(self, data: bytes) -> None:
        while data:
            out = self._decoder.decompress(data)
            self._emit(out)
            if not self._decoder.eof:
                self._in += len(data)
                return
            unused = self._decoder.unused_data
            self._in += len(data) - len(unused)
            self.frames.append((self._frame_out, self.out, self._frame_in, self._in))
            self._frame_in, self._frame_out = self._in, self.out
            self._pending = []
            self._decoder = self._zstd.ZstdDecompressor().decompressobj()  # type: ignore[attr-defined]
            data = unused

    def _emit(self, out: bytes) -> None:
        if not out:
            return
        if self.out + len(out) > self._layer.size * MAX_RATIO + SLACK:
            raise OSError(f"the layer inflates past {MAX_RATIO} times its size (a zstd bomb?)")
        self._buffer = self._buffer[self._at :] + out if self._buffer else out
        self._at = 0
        if not self._spooling:
            self._pending.append(out)
            if self.out + len(out) - self._frame_out > FRAME_MAX:  # a frame too large to enter: the layer is read whole
                self._spooling = True
                self._spool_earlier_frames()
                for piece in self._pending:
                    self._write(piece)
                self._pending = []
        else:
            self._write(out)
        self.out += len(out)

    def _write(self, out: bytes) -> None:
        """Spool ``out``, the output that follows what is spooled, up to the limit."""
        if self.spool_full:
            return
        if self._spool.tell() + len(out) > self._limit:
            self.spool_full = True
            self._spool.close()
        else:
            self._spool.write(out)

    def _spool_earlier_frames(self) -> None:
        """The output of the frames before the current one, decompressed again from the blob into the spool."""
        for frame in self.frames:
            if self.spool_full:
                return
            self._write(self._layer.inflate(frame))

    def finish(self) -> None:
        """Read to the blob's end: every frame noted (the tar's end is not the stream's)."""
        while self._more():
            self._position += len(self._buffer) - self._at
            self._at = len(self._buffer)
        if self.out > self._frame_out or self._in > self._frame_in:
            raise OSError("the last zstd frame is cut short")
