"""NumPy's own files: ``.npy`` (one array) and ``.npz`` (a zip of ``.npy`` members, as ``np.savez`` writes it).

Read as ``numpy.lib.format`` reads them, in its order: the magic ``\\x93NUMPY`` and a version (1.0, 2.0, 3.0), the
header's length (2 bytes, or 4 from 2.0), the header (a Python literal dict of ``descr``, ``fortran_order`` and
``shape``, at most 10,000 bytes as ``np.load`` allows), then the data. A ``.npz``'s members are found through its
central directory (``formats.zip``), each member ``name.npy`` a tensor ``name``; a lone ``.npy`` is a one-tensor model
named after its file. A C-order array is the range of its data; a Fortran-order one is gathered into C order
(``formats.gather``). Refused in one line: a compressed member (``np.savez_compressed``), an object array (a pickle),
a big-endian array, a dtype safetensors has no name for (complex128, strings, records), a header ``np.load`` refuses,
data shorter than the shape says.
"""

from __future__ import annotations

import ast
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from .. import errors
from .base import Format, Header, RangeFetcher, ReadMany, TensorEntry, made_header, read_exact
from .gather import Strided
from .zip import (
    EntryNotStored,
    Words,
    ZipError,
    check_stored,
    directory,
    first_member,
    local_headers,
    next_headers,
    reworded,
)

MAGIC = b"\x93NUMPY"
MAX_HEADER = 10_000  # np.load's max_header_size: a longer header is refused (it would be literal_eval'd)
PREFIX_READ = 256  # bytes of a member's data read with its local header: np.save's headers are 64 or 128
# NumPy's descr -> safetensors' dtype and its bytes, for the dtypes both have ('|': no byte order, one byte)
DTYPES = {
    "|b1": ("BOOL", 1),
    "|u1": ("U8", 1),
    "|i1": ("I8", 1),
    "<u2": ("U16", 2),
    "<i2": ("I16", 2),
    "<f2": ("F16", 2),
    "<u4": ("U32", 4),
    "<i4": ("I32", 4),
    "<f4": ("F32", 4),
    "<u8": ("U64", 8),
    "<i8": ("I64", 8),
    "<f8": ("F64", 8),
    "<c8": ("C64", 8),
}


class NumpyError(errors.RuleError):
    """A ``.npy`` or ``.npz`` file is refused: it breaks a rule of ``numpy.lib.format``'s reader, or holds what a
    tensor file cannot serve. ``rule_text`` names the rule in a few words."""

    rule_text = "invalid NumPy file"
    format_name = "NumPy .npy/.npz file"
    advice = "np.load refuses it too: write the arrays again with np.save or np.savez"


class NotNpy(NumpyError):
    """A ``.npy`` (or a ``.npz``'s member) that does not begin with ``\\x93NUMPY`` and a version NumPy writes."""

    rule_text = "magic and version"


class InvalidNpyHeader(NumpyError):
    """The header is not the dict ``np.load`` reads: a Python literal of exactly ``descr``, ``fortran_order`` (a bool)
    and ``shape`` (a tuple of non-negative integers), at most 10,000 bytes."""

    rule_text = "header"


class ObjectArray(NumpyError):
    """An array of Python objects: its data is a pickle (``allow_pickle``), never read by stfs."""

    rule_text = "no object arrays"
    advice = "its data is a pickle, never run by stfs: save the arrays as numbers (a numeric dtype, not object)"


class BigEndianArray(NumpyError):
    """A big-endian array (``descr`` ``>f4``): tensor files are little-endian."""

    rule_text = "little-endian data"
    advice = "save it little-endian: np.save(f, a.astype(a.dtype.newbyteorder('<')))"


class UnsupportedDtype(NumpyError):
    """A dtype safetensors has no name for: complex128, strings, records, void."""

    rule_text = "a dtype safetensors has"
    advice = "save it as one safetensors has (bool, integers, float16/32/64, complex64), e.g. a.astype(np.float32)"


class NpyTruncated(NumpyError):
    """The data (or the header) ends before its shape says."""

    rule_text = "bytes inside the file"
    advice = errors.CUT_SHORT


class InvalidNpz(NumpyError):
    """The ``.npz``'s zip structure is broken, or a member appears twice."""

    rule_text = "zip archive"


class CompressedMember(NumpyError):
    """A member is compressed (``np.savez_compressed``) or encrypted: its bytes are not in the file as they are."""

    rule_text = "stored members"
    advice = (
        "a tensor's file is its bytes in the file as they are: save it again with np.savez, which stores them: "
        "python3 -c \"import numpy as np; np.savez('{stem}-stored.npz', **np.load('{path}'))\""
    )


WORDS: Words = {
    EntryNotStored: lambda path, detail: CompressedMember(path, f"{detail}, as np.savez_compressed writes it"),
    ZipError: InvalidNpz,
    errors.TruncatedFile: NpyTruncated,
}


@dataclass(frozen=True, slots=True)
class NpyEntry(TensorEntry):
    """A tensor of a NumPy file: ``begin``/``end`` absolute in the file (its ``Header`` has ``data_start`` 0); a
    Fortran-order one's elements gathered in C order by ``fortran``. Its files' xattrs ``user.npz.*`` add ``member``,
    the ``.npz`` member holding it."""

    member: str = ""
    fortran: Strided | None = None

    @property
    def scattered(self) -> Strided | None:
        return self.fortran

    @property
    def xattrs(self) -> Mapping[str, str]:
        return {"member": self.member} if self.member else {}


@dataclass(frozen=True, slots=True)
class Array:
    """A ``.npy``'s header: its dtype (safetensors' name) and item size, order, shape, and where its data starts."""

    dtype: str
    itemsize: int
    fortran_order: bool
    shape: tuple[int, ...]
    data_offset: int  # bytes from the start of the .npy to its data


def read_array_header(prefix: bytes, path: str, where: str) -> Array | int:
    """The header of the ``.npy`` whose first bytes are ``prefix``; where ``prefix`` is too short to hold it, how many
    bytes it needs. ``where``: how a message names the array (a member's name)."""
    if len(prefix) < 8 or prefix[:6] != MAGIC:
        raise NotNpy(path, f"{where}does not begin with \\x93NUMPY (its first bytes are {prefix[:8]!r})")
    major, minor = prefix[6], prefix[7]
    if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
        raise NotNpy(path, f"{where}version {major}.{minor}: NumPy writes 1.0, 2.0 and 3.0")
    fixed = 10 if major == 1 else 12
    if len(prefix) < fixed:
        return fixed
    length = struct.unpack_from("<H" if major == 1 else "<I", prefix, 8)[0]
    if length > MAX_HEADER:
        raise InvalidNpyHeader(path, f"{where}a header of {length} bytes (np.load reads at most {MAX_HEADER:,})")
    if len(prefix) < fixed + length:
        return fixed + length
    raw = prefix[fixed : fixed + length]
    try:
        text = raw.decode("utf-8" if major == 3 else "latin1")
        value = ast.literal_eval(text)
    except (UnicodeDecodeError, ValueError, SyntaxError, MemoryError, RecursionError, TypeError) as exc:
        raise InvalidNpyHeader(path, f"{where}its header is not a Python literal: {type(exc).__name__}") from None
    if not isinstance(value, dict) or set(value) != {"descr", "fortran_order", "shape"}:
        raise InvalidNpyHeader(path, f"{where}its header is not a dict of descr, fortran_order and shape: {text!r:.80}")
    shape, fortran_order, descr = value["shape"], value["fortran_order"], value["descr"]
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise InvalidNpyHeader(path, f"{where}shape {shape!r:.60} is not a tuple of non-negative integers")
    if not isinstance(fortran_order, bool):
        raise InvalidNpyHeader(path, f"{where}fortran_order {fortran_order!r:.60} is not a bool")
    if not isinstance(descr, str):  # a list: a record dtype
        raise UnsupportedDtype(path, f"{where}a record dtype {descr!r:.60}: safetensors has a name for none")
    if descr[1:2] == "O" or descr == "O":
        raise ObjectArray(path, f"{where}an array of Python objects: its data is a pickle, which stfs never reads")
    found = DTYPES.get(descr)
    if found is None and descr.startswith(">") and "<" + descr[1:] in DTYPES:
        raise BigEndianArray(path, f"{where}big-endian dtype {descr!r}: re-save it as {'<' + descr[1:]!r}")
    if found is None:
        raise UnsupportedDtype(path, f"{where}dtype {descr!r}, which safetensors has no name for")
    return Array(found[0], found[1], fortran_order, shape, fixed + length)


def array_entry(name: str, array: Array, start: int, available: int, path: str, member: str = "") -> NpyEntry:
    """The tensor ``name`` of ``array`` whose data starts at the absolute ``start`` of the file, ``available`` bytes
    from there to the end of its ``.npy`` (more than its shape needs is ignored, as ``np.load`` ignores it)."""
    nbytes = math.prod(array.shape) * array.itemsize
    if nbytes > available:
        where = f"member {member!r}: " if member else ""
        raise NpyTruncated(path, f"{where}shape {list(array.shape)} needs {nbytes} bytes of data, it has {available}")
    fortran = None
    if array.fortran_order and sum(n > 1 for n in array.shape) > 1:  # else Fortran order is C order
        strides = tuple(math.prod(array.shape[:i]) for i in range(len(array.shape)))
        fortran = Strided(start, 0, array.shape, strides, array.itemsize)
    return NpyEntry(name, array.dtype, array.shape, start, start + nbytes, member, fortran)


def read_npy(fetch: RangeFetcher, path: str, file_size: int, first_read: int) -> NpyEntry:
    """A lone ``.npy``: one tensor named after its file (``w.npy``: ``w``)."""
    prefix = read_exact(fetch, 0, min(file_size, max(first_read, PREFIX_READ)), path)
    array = read_array_header(prefix, path, "")
    if isinstance(array, int):
        if array > file_size:
            raise NpyTruncated(path, f"its header ends at byte {array}, past the end of the file ({file_size})")
        array = read_array_header(read_exact(fetch, 0, array, path), path, "")
        assert not isinstance(array, int)
    stem = path.rpartition("/")[2]
    name = stem[: -len(".npy")] if stem.endswith(".npy") else stem
    return array_entry(name, array, array.data_offset, file_size - array.data_offset, path)


def read_npz(fetch: RangeFetcher, many: ReadMany, path: str, file_size: int) -> tuple[list[NpyEntry], list[str]]:
    """A ``.npz``: each stored member ``name.npy`` the tensor ``name``, in the archive's order; warnings for members
    that are not ``.npy`` (left out)."""
    entries, cd_start = directory(fetch, file_size, path)
    members = []
    warnings = []
    seen: set[str] = set()
    for entry in entries:
        if entry.name.endswith("/"):
            continue
        if not entry.name.endswith(".npy"):
            warnings.append(f"{path}: member {entry.name!r} is not a .npy: no tensor (the file is in files/)")
            continue
        if entry.name in seen:
            raise InvalidNpz(path, f"member {entry.name!r} appears twice")
        seen.add(entry.name)
        check_stored(entry, path)
        members.append(entry)
    want = [min(entry.size, PREFIX_READ) for entry in members]
    placed = local_headers(fetch, many, members, want, next_headers(members, entries, cd_start), cd_start, path)
    tensors = []
    for entry, (start, prefix) in zip(members, placed, strict=True):
        where = f"member {entry.name!r}: "
        array = read_array_header(prefix, path, where)
        if isinstance(array, int):
            if array > entry.size:
                raise NpyTruncated(path, f"{where}its header ends at byte {array} of its {entry.size}")
            array = read_array_header(read_exact(fetch, start, array, path), path, where)
            assert not isinstance(array, int)
        name = entry.name[: -len(".npy")]
        available = entry.size - array.data_offset
        tensors.append(array_entry(name, array, start + array.data_offset, available, path, entry.name))
    return tensors, warnings


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read and validate the ``.npy`` or ``.npz`` file ``path`` through ``fetch`` as a ``Header``: tensors at
    absolute offsets (``data_start`` 0), ``header.json`` the equivalent safetensors file's JSON."""
    many = getattr(fetch, "many", None) or (lambda ranges: [fetch(offset, size) for offset, size in ranges])
    with reworded(path, WORDS):
        head = read_exact(fetch, 0, min(file_size, 8), path)
        warnings: list[str] = []
        if head.startswith(b"PK"):
            tensors, warnings = read_npz(fetch, many, path, file_size)
        else:
            tensors = [read_npy(fetch, path, file_size, first_read)]
    metadata = {"format": "np"}  # as a safetensors file written from NumPy arrays says where they came from
    return made_header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tensors,
        metadata=metadata,
        warnings=tuple(warnings),
    )


class _Numpy(Format):
    name = "npz"
    title = "NumPy .npy/.npz"
    head_size = 512  # a zip's first local header and the name of its first member

    def sniff(self, head: bytes) -> bool:
        """A ``.npy``'s magic, or a zip whose first member is a ``.npy``."""
        return head.startswith(MAGIC) or (first_member(head) or "").endswith(".npy")

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def safetensors_name(self, path: str) -> str | None:
        """``x.npz`` or ``x.npy`` -> ``x.safetensors``."""
        folder, _, name = path.rpartition("/")
        name = (name[: name.rindex(".")] if "." in name else name) + ".safetensors"
        return f"{folder}/{name}" if folder else name


FORMAT: Format = _Numpy()
