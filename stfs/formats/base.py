"""What every format gives the rest of stfs: a file's validated tensors and metadata, and where its header is
(``Header``, ``TensorEntry``), and what a format is (``Format``)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import errors

RangeFetcher = Callable[[int, int], bytes]  # (offset, size) -> bytes, short only at the end of the file
# Several (offset, size) ranges -> their bytes, in order: where reads are costly (a remote source), the caller may
# issue them at once (a fetch's ``many``); without one, they are read one after another.
ReadMany = Callable[[Sequence[tuple[int, int]]], Sequence[bytes]]

COALESCE_GAP = 4096  # two ranges closer than this are read as one (``read_ranges``)


class Read(Protocol):
    """How a ``Scattered`` reads: exactly ``size`` bytes from the absolute ``offset`` of its tensor's file, or of
    ``file``, another file of that file's folder named as a header names it (a DCP tensor's chunks in several);
    ``span`` (absolute ``(first, end)`` in that file) the bytes the read is part of (its chunk), within which a remote
    source fetches and reads ahead, as it does within a tensor."""

    def __call__(
        self, offset: int, size: int, file: str | None = None, span: tuple[int, int] | None = None
    ) -> bytes: ...


class Folder(Protocol):
    """The other files of a header's folder, by name relative to it, for a format that reads them to place its
    tensors (a DCP's ``.metadata`` names the files its tensors' chunks lie in, whose framing it reads)."""

    def size(self, file: str) -> int | None:
        """Its size, pinning it for the mount as a header's file is; ``None`` where it is not a regular file."""
        ...

    def fetcher(self, file: str) -> RangeFetcher:
        """Its bytes, as a header's own ``fetch`` (with its ``many``, reading ranges at once)."""
        ...


Part = tuple[str | None, int, int, int]  # (file, first, length, stride): see Rows


@dataclass(frozen=True, slots=True)
class Rows:
    """The next ``count`` rows of a tensor's bytes in C order, each row the concatenation of its ``parts``: part
    ``(file, first, length, stride)`` is ``length`` bytes from ``first + row * stride`` of ``file`` (``None``: the
    tensor's own file; else another file of its folder, as ``Read`` names it). A tensor of one run is one row of one
    part; one sharded by rows one row of a part per chunk; one sharded by columns a row per tensor row, a part per
    chunk: what a reader that is not Python walks as it walks a range (stfs._native)."""

    count: int
    parts: tuple[Part, ...]

    @property
    def row_bytes(self) -> int:
        return sum(part[2] for part in self.parts)


class Scattered(Protocol):
    """A tensor whose bytes in C order are not one range of its file (a strided tensor of a checkpoint): its
    elements are gathered from ``span`` as they are read."""

    @property
    def offset(self) -> int:
        """Absolute offset of its first element in its file (the ``offset`` xattr)."""
        ...

    @property
    def span(self) -> tuple[int, int]:
        """``(absolute offset, size)`` of the part of its file that holds its elements."""
        ...

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        """Fill ``view`` with its bytes in C order from ``begin``, reading its file (or files) through ``read``."""
        ...

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        """Its bytes in C order as ``Rows`` of runs of its files (or bytes it holds), at most ``limit`` parts in all;
        else why not (a transpose: every element a run of its own; more parts than ``limit``)."""
        ...


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a file; ``begin``/``end`` are relative to its data section.

    ``namespace`` (its files' extended attributes: ``user.<namespace>.name``, ...) is not the format's to give: it
    is the name of the ``Format`` that read it, filled by ``formats.read_with``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    namespace: str = field(default="", init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.end - self.begin

    @property
    def parameters(self) -> int:
        return math.prod(self.shape)

    @property
    def scattered(self) -> Scattered | None:
        """How its bytes are gathered in C order where they are not the one range ``begin``..``end``."""
        return None

    @property
    def file(self) -> str | None:
        """The file its bytes lie in where that is not its header's (an ONNX model's external data): a path
        relative to the folder of the header's file, inside it; ``begin``/``end`` are then absolute in that file.
        For a ``scattered`` tensor, the file of its first element (a DCP tensor's chunks lie in several)."""
        return None

    @property
    def xattrs(self) -> Mapping[str, str]:
        """Extended attributes its format adds to those of every tensor's file, by name less ``user.<namespace>.``."""
        return {}


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header of the file at ``path``: its tensors (in the order the file lists them), its metadata
    as strings, where its data section starts, and its ``header.json``: the JSON as stored at ``json_at`` (offset,
    length) in the file, or ``json_made``, made from a header that is not JSON.

    Two members are not the format's to give, so that it cannot give them wrong: ``format``, the name of the
    ``Format`` that read it (filled by ``formats.read_with``), and ``scattered``, whether any of its tensors is
    (``TensorEntry.scattered``), derived from them."""

    path: str
    file_size: int
    mtime_ns: int
    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]
    digest: bytes  # of the header bytes: tells two headers apart (diagnostics)
    data_start: int
    json_at: tuple[int, int] | None = None
    json_made: bytes | None = None
    parsed: Any = None  # the format's own header, where checks across files need it (a GGUF split set)
    warnings: tuple[str, ...] = ()  # one line each, for a mount's stderr (a checkpoint's tensors left out)
    check_problems: tuple[str, ...] = ()  # lines ``stfs check`` fails on though a mount serves the file
    # Other files of its folder the model's tensors lie in (an ONNX model's external data, a DCP's .distcp files),
    # relative to that folder: each tensor whose bytes are in one says which (``TensorEntry.file``); ``files/`` shows
    # them all.
    other_files: tuple[str, ...] = ()
    # Tensors that are not the model's weights, by the folder of the model's tree they are files of (a training
    # checkpoint's optimizer states: ``optimizer/exp_avg``): ``tensors/``'s kind of files, in no header.json or view.
    folders: Mapping[str, tuple[TensorEntry, ...]] = field(default_factory=dict)
    format: str = field(default="", init=False)  # the name of the ``Format`` that read it
    scattered: bool = field(default=False, init=False)  # some tensor's bytes are not one range of the file

    def __post_init__(self) -> None:
        # a views fast path serves every tensor of a header that is not scattered as one range of its file
        object.__setattr__(self, "scattered", any(entry.scattered is not None for entry in self.tensors))

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


@dataclass(frozen=True, slots=True)
class SplitSet:
    """A set of files that is one model without an index (a ``gguf-split`` set), merged: its metadata as
    ``metadata/`` shows it and its ``header.json``."""

    metadata: Mapping[str, str]
    json_made: bytes


class Format:
    """A format stfs reads: how its files are recognised and read, and what it adds to the rest.

    A format is one module of ``stfs.formats`` whose ``FORMAT`` is an instance of this (or of a subclass), listed
    in ``formats.REGISTRY``. The defaults fit a format of single files holding each tensor as one range.
    """

    name: str = ""  # as ``info`` and the xattrs name it
    title: str = ""  # as a message names it: "safetensors", "GGUF", "PyTorch checkpoint"
    head_size: int = 16  # the first bytes ``sniff`` looks at
    confirm_in_folder: bool = False  # a file a folder holds under one of its names is a model only if ``sniff`` says
    # a file of it stands for the folder holding it: every model file at or below that folder is part of that one
    # model (a DeepSpeed checkpoint's rank files and other steps), shown in files/ only
    folder_model: bool = False

    def sniff(self, head: bytes) -> bool:
        """Whether a file whose first ``head_size`` bytes (fewer for a shorter file) are ``head`` is of this format."""
        raise NotImplementedError

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        """Read and validate the file ``path`` through ``fetch``; raise a named ``FormatError`` on a broken rule.

        ``fetch`` may carry more, where its caller has it: ``fetch.many(ranges)``, ranges read at once (a remote
        source's in parallel), and ``fetch.folder``, a ``Folder`` of the other files of the file's folder (the
        ``.distcp`` files a DCP's ``.metadata`` names)."""
        raise NotImplementedError

    def dtype(self, name: str) -> DType | None:
        """A dtype this format adds to safetensors' (``formats.dtypes``); ``None`` for one it does not."""
        return None

    def split_set(self, file_name: str) -> tuple[str, list[str]] | None:
        """For a file of a set that is one model without an index, the set's name and its files' names in order."""
        return None

    def merge_split_set(self, name: str, files: Sequence[str], headers: Sequence[Header | None]) -> SplitSet:
        """Check a split set (``headers[i]`` is ``None`` where ``files[i]`` is missing) and merge it."""
        raise NotImplementedError

    def safetensors_name(self, path: str) -> str | None:
        """The name of the file at ``path`` in ``--view safetensors``, where it is shown converted (its header
        ``json_made`` with each tensor's bytes after it); ``None``: shown as it is."""
        return None

    def safetensors_names(self, path: str) -> tuple[str, ...]:
        """Its names in ``--view safetensors`` by preference, the first that the source's files do not hold taken
        (``flax_model.msgpack``: ``model.safetensors``, else ``flax_model.safetensors``); by default the one
        ``safetensors_name`` gives."""
        name = self.safetensors_name(path)
        return (name,) if name is not None else ()

    def index_name(self, name: str) -> str:
        """The tensor an index's ``weight_map`` key ``name`` stands for, as this format's headers name it (transformers
        names a Flax shard's tensors by their keys joined by ``/``)."""
        return name


@dataclass(frozen=True, slots=True)
class DType:
    """A tensor dtype: ``group_values`` values take ``group_bytes`` bytes (F4 two a byte, F6 four in three bytes, a
    GGML type its block); ``decode``, where the format decodes its values itself (a GGML block's), fills a float32
    buffer from whole groups; ``has_values``: whether its values can be read as numbers (not C64's)."""

    name: str
    group_values: int
    group_bytes: int
    has_values: bool = True
    decode: Callable[[memoryview, memoryview], None] | None = None

    @property
    def element_bytes(self) -> int:
        """Bytes of one value, for a dtype of whole bytes a value; 0 for a packed one."""
        return self.group_bytes if self.group_values == 1 else 0


def encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode (a JSON ``\\uD800`` escape can make a str that is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def header_json(tensors: Sequence[TensorEntry], metadata: Mapping[str, str]) -> bytes:
    """``header.json`` made for a header that is not safetensors' (``Header.json_made``): the header of the
    safetensors file holding ``tensors`` one after another in their order, ``__metadata__`` ``metadata`` (a
    surrogate escape written back as the byte it stands for)."""
    document: dict[str, Any] = {"__metadata__": dict(metadata)}
    begin = 0
    for entry in tensors:
        document[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [begin, begin + entry.size],
        }
        begin += entry.size
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogateescape")


def made_header(
    *,
    path: str,
    file_size: int,
    mtime_ns: int,
    tensors: Sequence[TensorEntry],
    metadata: Mapping[str, str],
    **rest: Any,
) -> Header:
    """The ``Header`` of a format that is not safetensors: its tensors and metadata with the ``header.json`` made for
    them (``header_json``), digested; ``rest`` the other fields (``warnings``, ``parsed``, ``folders``, ...)."""
    made = header_json(tensors, metadata)
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tuple(tensors),
        metadata=metadata,
        digest=hashlib.sha256(made).digest(),
        data_start=0,
        json_made=made,
        **rest,
    )


def read_exact(read: RangeFetcher, offset: int, size: int, path: str) -> bytes:
    """Exactly ``size`` bytes of ``path`` from ``offset``; ``errors.TruncatedFile`` where the file ends before (a
    format words it as its own error where it likes)."""
    data = read(offset, size) if size > 0 else b""
    if len(data) < size:
        raise errors.TruncatedFile(path, f"file ends at byte {offset + len(data)}, inside bytes {offset}+{size}")
    return bytes(data)


def read_ranges(many: ReadMany, ranges: Sequence[tuple[int, int]], path: str) -> list[bytes]:
    """The bytes of each ``(offset, size)``, all asked for at once; ranges closer than ``COALESCE_GAP`` are one read;
    ``errors.TruncatedFile`` where the file ends before one."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    groups: list[tuple[int, int, list[int]]] = []  # start, end, the ranges it holds
    for i in order:
        start, end = ranges[i][0], sum(ranges[i])
        if groups and start <= groups[-1][1] + COALESCE_GAP:
            first, last, members = groups[-1]
            groups[-1] = (first, max(last, end), [*members, i])
        else:
            groups.append((start, end, [i]))
    blocks = many([(start, end - start) for start, end, _ in groups]) if groups else []
    out: list[bytes] = [b""] * len(ranges)
    for (start, end, members), block in zip(groups, blocks, strict=True):
        if len(block) < end - start:
            raise errors.TruncatedFile(
                path, f"file ends at byte {start + len(block)}, inside bytes {start}+{end - start}"
            )
        for k in members:
            offset, size = ranges[k]
            out[k] = bytes(block[offset - start : offset - start + size])
    return out
