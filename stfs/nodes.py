"""Nodes of the mounted tree. A file is one thing: an ordered tuple of segments.

A segment is bytes held in memory (``header.json`` of a sharded set, a metadata value, a ``.npy``
header), a ``Range`` of a source file (a tensor, a shard's ``header.json``, a whole source file),
a ``Decoded`` range (a tensor's values as float32, for ``f32/`` and ``npy/``), or a ``Summary`` (a file
made from a whole tensor on its first read, for ``stats/`` and ``png/``), or a ``Gathered`` tensor (a strided tensor
of a PyTorch checkpoint, its elements put in C order as read). Every file is read by one
function, ``read_into``; the FUSE layer splices the ``Range`` pieces of a read (``pieces``) where its
source can, and puts the others in memory.
"""

from __future__ import annotations

import json
import stat
import threading
from bisect import bisect_right
from typing import TYPE_CHECKING

from .chunks import CHUNK_BYTES, ReadInto, TensorBytes
from .formats import Rows, Scattered, TensorEntry
from .sources import join_key, parent_key

if TYPE_CHECKING:
    from .decode import Codec
    from .summary import Finished, Make

DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444


class Range:
    """``size`` bytes of the source file ``key`` from its byte ``offset``."""

    __slots__ = ("key", "offset", "size")

    def __init__(self, key: str, offset: int, size: int) -> None:
        self.key = key
        self.offset = offset
        self.size = size

    def __repr__(self) -> str:
        return f"Range({self.key!r}, {self.offset}, {self.size})"


class Gathered:
    """The ``size`` bytes of a tensor that is not one range of the source file ``key`` (a ``formats.Scattered``: a
    strided tensor of a checkpoint), in C order, gathered as read; ``offset`` is where its first element lies.

    The views made from a tensor's bytes (``Decoded``, ``Summary``) read them gathered too (``tensor_bytes``).
    """

    __slots__ = ("key", "offset", "size", "tensor")

    def __init__(self, key: str, offset: int, size: int, tensor: Scattered) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Gathered({self.key!r}, {self.offset}, {self.size}, {self.tensor!r})"

    def read_into(self, start: int, view: memoryview, read_source: ReadInto) -> None:
        """Fill all of ``view`` with the tensor's bytes in C order from ``start`` (within ``size``); ``OSError`` if
        the source is short."""
        tensor_bytes(self.key, self.offset, self.size, "U8", read_source, self).read_into(start, view)


def tensor_bytes(
    key: str,
    offset: int,
    size: int,
    dtype: str,
    read_source: ReadInto,
    gathered: Gathered | None,
    shape: tuple[int, ...] = (),
) -> TensorBytes:
    """The ``size`` bytes of a tensor of ``dtype`` at ``offset`` of ``key``, or ``gathered``, as the chunked reader
    reads them."""
    scattered = gathered.tensor if gathered is not None else None
    return TensorBytes(key, offset, size, dtype, shape, read_source, scattered)


class Decoded:
    """``size`` bytes of float32 values decoded by ``codec`` (a ``decode.Codec``) from the tensor's bytes in
    the source file ``key`` from ``offset`` (or, with ``gathered``, from a strided tensor's bytes in C order).

    A read decodes only the whole groups of source values that cover it (an F4 byte holds two, three F6
    bytes four), ``chunks.CHUNK_BYTES`` bytes of output at a time.
    """

    __slots__ = ("key", "offset", "size", "codec", "gathered")

    def __init__(self, key: str, offset: int, size: int, codec: Codec, gathered: Gathered | None = None) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.codec = codec
        self.gathered = gathered

    def __repr__(self) -> str:
        return f"Decoded({self.key!r}, {self.offset}, {self.size}, {self.codec.dtype})"

    def read_into(self, start: int, view: memoryview, read_source: ReadInto) -> None:
        """Fill all of ``view`` with the decoded bytes from ``start`` (within ``size``); ``OSError`` if the
        source is short."""
        codec = self.codec
        group_bytes, group_out = codec.group_bytes, codec.group_out
        source_size = self.size // group_out * group_bytes
        tensor = tensor_bytes(self.key, self.offset, source_size, codec.dtype, read_source, self.gathered)
        chunk_groups = max(1, CHUNK_BYTES // group_out)
        end = start + len(view)
        done = 0
        while start + done < end:
            first = (start + done) // group_out
            last = min((end + group_out - 1) // group_out, first + chunk_groups)
            source = _source_buffer((last - first) * group_bytes)
            tensor.read_into(first * group_bytes, source)
            skip = start + done - first * group_out  # the read begins inside a group
            length = min(end - start - done, (last - first) * group_out - skip)
            if skip == 0 and length == (last - first) * group_out:
                codec.decode(source, view[done : done + length])
            else:
                decoded = memoryview(bytearray((last - first) * group_out))
                codec.decode(source, decoded)
                view[done : done + length] = decoded[skip : skip + length]
            done += length


_scratch = threading.local()


def _source_buffer(size: int) -> memoryview:
    """``size`` bytes of this thread's buffer for source bytes to decode (kept: one allocation per thread)."""
    buffer: bytearray | None = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratch.buffer = bytearray(size)
    return memoryview(buffer)[:size]


class Summary:
    """``size`` bytes made by ``make`` from the whole tensor ``tensor`` (in the source file ``key`` from
    ``offset``) on the first read: a ``stats/`` or ``png/`` file, whose size is known from the header alone.

    ``finished`` (a ``summary.Finished``) makes each once, one at a time, and keeps the finished bytes.
    """

    __slots__ = ("key", "offset", "size", "tensor", "make", "finished", "gathered")

    def __init__(
        self,
        key: str,
        offset: int,
        size: int,
        tensor: TensorEntry,
        make: Make,
        finished: Finished,
        gathered: Gathered | None = None,
    ) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.tensor = tensor
        self.make = make
        self.finished = finished
        self.gathered = gathered  # a strided tensor: its bytes in C order, read through its reader

    def __repr__(self) -> str:
        return f"Summary({self.key!r}, {self.offset}, {self.size}, {self.make.__name__})"

    def read_into(self, start: int, view: memoryview, read_source: ReadInto) -> None:
        """Fill all of ``view`` with the file's bytes from ``start`` (within ``size``), making the file first if
        need be; raises what making it raised (``OSError`` of the source, ...)."""
        entry = self.tensor
        tensor = tensor_bytes(self.key, self.offset, entry.size, entry.dtype, read_source, self.gathered, entry.shape)
        view[:] = self.finished.bytes_of(self, self.make, tensor)[start : start + len(view)]


Segment = bytes | Range | Decoded | Summary | Gathered
Segments = tuple[Segment, ...]


class ShardData:
    """The data section of the source file ``key``, from its byte ``start``: what the files of its tensors share.

    A tensor's file of ``tensors/`` holds this instead of its segments and makes its one ``Range`` (from its
    tensor's offsets) when asked: one shared object instead of a ``Range``, a tuple and an offset per tensor
    (14 MiB of 100,000 tensors' mount, which the C tables answering the kernel have made the larger part).
    """

    __slots__ = ("key", "start")

    def __init__(self, key: str, start: int) -> None:
        self.key = key
        self.start = start

    def __repr__(self) -> str:
        return f"ShardData({self.key!r}, {self.start})"


class FileNode:
    """A file: its bytes are its ``segments`` one after another.

    A tensor's file (and a view of it) keeps its ``TensorEntry``: its extended attributes are made
    from that when asked for. A plain slotted class: one is made per tensor, and a dataclass
    would be slower to build. A tensor's file of ``tensors/`` is given its shard's ``ShardData`` for
    segments (and its size): ``segments`` is then its tensor's ``Range``, made on each use.
    """

    __slots__ = ("inode", "mtime_ns", "size", "stored", "tensor", "view")

    def __init__(
        self,
        inode: int,
        mtime_ns: int,
        segments: Segments | ShardData,
        tensor: TensorEntry | None = None,
        view: str | None = None,
        size: int | None = None,
    ) -> None:
        self.inode = inode
        self.mtime_ns = mtime_ns
        self.stored = segments
        if size is None:
            assert type(segments) is tuple, "a file of a shard's data is given its size"
            size = sum(_length(segment) for segment in segments)
        self.size = size
        self.tensor = tensor
        self.view = view

    @property
    def segments(self) -> Segments:
        stored = self.stored
        if type(stored) is tuple:
            return stored
        assert type(stored) is ShardData and self.tensor is not None
        return (Range(stored.key, stored.start + self.tensor.begin, self.size),)

    def __repr__(self) -> str:
        return f"FileNode(inode={self.inode}, size={self.size}, segments={self.segments!r})"


class DirNode:
    """A folder: its entries by (escaped) name, in the order they were made."""

    __slots__ = ("inode", "mtime_ns", "children", "parent")

    def __init__(self, inode: int, mtime_ns: int, parent: DirNode | None = None) -> None:
        self.inode = inode
        self.mtime_ns = mtime_ns
        self.children: dict[str, FileNode | DirNode] = {}
        self.parent = self if parent is None else parent  # the root is its own parent, as "/.." is "/"

    def __repr__(self) -> str:
        return f"DirNode(inode={self.inode}, entries={len(self.children)})"


Node = FileNode | DirNode


def _length(segment: Segment) -> int:
    return len(segment) if type(segment) is bytes else segment.size  # type: ignore[union-attr]


def clamp(node: FileNode, offset: int, size: int) -> int:
    """How many of ``size`` bytes from ``offset`` the file holds: reads past its end are short or empty."""
    count = min(size, node.size - offset)
    return count if count > 0 else 0


def pieces(node: FileNode, offset: int, count: int) -> list[tuple[Segment, int, int]]:
    """The segments that hold ``count`` bytes of ``node`` from ``offset`` (clamped already):
    ``(segment, start within it, length)`` in order."""
    found: list[tuple[Segment, int, int]] = []
    position = 0
    end = offset + count
    for segment in node.segments:
        length = _length(segment)
        low, high = max(offset, position), min(end, position + length)
        if low < high:
            found.append((segment, low - position, high - low))
        position += length
        if position >= end:
            break
    return found


def read_into(node: FileNode, offset: int, view: memoryview, read_source: ReadInto) -> int:
    """Fill the start of ``view`` (bytes) with ``node``'s bytes from ``offset``; return the count (clamped at its end).

    ``read_source`` reads a ``Range`` (a source's ``read_into``, told the whole range as its ``span``: a
    remote source fetches and reads ahead within it); it may raise ``OSError``.
    """
    count = clamp(node, offset, len(view))
    segments = node.segments
    if len(segments) == 1:  # a tensor, or a whole file: the one read a request costs
        segment = segments[0]
        if isinstance(segment, Range):
            if not count:
                return 0
            start = segment.offset
            return read_source(
                segment.key, start + offset, view if count == len(view) else view[:count], (start, start + segment.size)
            )
    done = 0
    for segment, start, length in pieces(node, offset, count):
        if type(segment) is Range:
            span = (segment.offset, segment.offset + segment.size)
            got = read_source(segment.key, segment.offset + start, view[done : done + length], span)
            if got != length:
                raise OSError(f"{segment.key}: short read at byte {segment.offset + start}")
        elif type(segment) is Decoded or type(segment) is Summary or type(segment) is Gathered:
            segment.read_into(start, view[done : done + length], read_source)
        else:
            view[done : done + length] = segment[start : start + length]  # type: ignore[index]
        done += length
    return done


PART_LIMIT = 1 << 18  # runs of one file a reader outside Python walks at most: its tables stay bounded (8 MiB)

Part = tuple[str, int, int, int]  # (source key, first, length, stride): see formats.Rows
Block = bytes | tuple[int, tuple[Part, ...]]  # bytes, or (rows, parts)


def lower(node: FileNode, limit: int = PART_LIMIT) -> list[Block] | str | None:
    """``node``'s bytes as blocks of runs, for a reader outside Python to walk as it walks a range (``stfs._native``):
    bytes, or ``(rows, parts)``: a ``formats.Rows`` whose parts name their source by key. ``None`` for a file that
    is one ``Range`` (read as a range already) or holds no ``Range`` or ``Gathered`` (bytes alone, decoded values, a
    summary); why not for one whose gathered tensor is not (``Scattered.layout``: a transpose, too many runs)."""
    stored = node.stored
    if type(stored) is not tuple or (len(stored) == 1 and type(stored[0]) is Range):
        return None
    if not any(type(segment) is Gathered or type(segment) is Range for segment in stored):
        return None
    blocks: list[Block] = []
    used = 0
    for segment in stored:
        if type(segment) is bytes:
            blocks.append(segment)
        elif type(segment) is Range:
            if segment.size:
                blocks.append((1, ((segment.key, segment.offset, segment.size, segment.size),)))
                used += 1
        elif type(segment) is Gathered:
            layout = segment.tensor.layout(limit - used)
            if isinstance(layout, str):
                return layout
            folder = parent_key(segment.key)
            for block in layout:
                if type(block) is bytes:
                    blocks.append(block)
                    continue
                assert isinstance(block, Rows)
                used += len(block.parts)
                parts = tuple(
                    (segment.key if file is None else join_key(folder, file), first, length, stride)
                    for file, first, length, stride in block.parts
                )
                blocks.append((block.count, parts))
        else:
            return None
        if used > limit:
            return f"more than {limit} runs"
    return blocks


class Lowered:
    """A file's blocks (``lower``), where each starts, and each part's extent in its source as a ``Range`` (a
    chunk): a read of it as runs of its sources, as stfs._native walks them, each within its part's extent."""

    __slots__ = ("blocks", "starts")

    def __init__(self, blocks: list[Block]) -> None:
        self.blocks: list[bytes | tuple[int, int, tuple[tuple[Range, int, int], ...]]] = []
        self.starts: list[int] = []
        position = 0
        for block in blocks:
            if type(block) is bytes:
                if block:
                    self.starts.append(position)
                    self.blocks.append(block)
                    position += len(block)
                continue
            assert type(block) is tuple
            rows, parts = block
            extents = tuple(
                (Range(key, first, (rows - 1) * stride + length), length, stride)
                for key, first, length, stride in parts
            )
            row_bytes = sum(length for _, length, _ in extents)
            self.starts.append(position)
            self.blocks.append((rows, row_bytes, extents))
            position += rows * row_bytes

    def runs(self, offset: int, count: int, limit: int) -> list[tuple[Segment, int, int]] | None:
        """The ``count`` bytes from ``offset`` (within the file) as pieces: runs of sources (``(extent, start within
        it, length)``) and bytes; ``None`` if they are more than ``limit``."""
        found: list[tuple[Segment, int, int]] = []
        index = bisect_right(self.starts, offset) - 1
        position, end = offset, offset + count
        while position < end:
            block, start = self.blocks[index], self.starts[index]
            index += 1
            if type(block) is bytes:
                take = min(end, start + len(block)) - position
                found.append((block, position - start, take))
                position += take
                continue
            assert type(block) is tuple
            rows, row_bytes, extents = block
            row, within = divmod(position - start, row_bytes)
            part = 0
            while within >= extents[part][1]:
                within -= extents[part][1]
                part += 1
            while position < end and row < rows:
                extent, length, stride = extents[part]
                take = min(length - within, end - position)
                found.append((extent, row * stride + within, take))
                if len(found) > limit:
                    return None
                position += take
                within = 0
                part += 1
                if part == len(extents):
                    part, row = 0, row + 1
        return found


def tensor_xattrs(node: FileNode) -> dict[str, bytes]:
    """The ``user.<format>.*`` extended attributes of a tensor's file (``user.safetensors.name``, ...; the format's
    namespace as its ``TensorEntry`` says), and ``user.stfs.view`` of a view's."""
    tensor = node.tensor
    source = next((segment for segment in node.segments if type(segment) is not bytes), None)
    if tensor is None or source is None:
        return {}
    assert isinstance(source, (Range, Decoded, Summary, Gathered))  # a view's file names the source bytes it is made of
    prefix = f"user.{tensor.namespace}."
    xattrs = {
        prefix + "name": tensor.name.encode("utf-8", "surrogatepass"),
        prefix + "dtype": tensor.dtype.encode(),
        prefix + "shape": json.dumps(list(tensor.shape), separators=(",", ":")).encode(),
        prefix + "file": source.key.encode("utf-8", "surrogateescape"),
        prefix + "offset": str(source.offset).encode(),
    }
    for name, value in tensor.xattrs.items():  # what its format adds (an ONNX tensor's data_type, ...)
        xattrs[prefix + name] = value.encode("utf-8", "surrogateescape")
    if node.view is not None:
        xattrs["user.stfs.view"] = node.view.encode()
    return xattrs


def file_mode(node: Node) -> int:
    return DIR_MODE if isinstance(node, DirNode) else FILE_MODE
