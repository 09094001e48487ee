"""What the seam checks of every header a format returns, before anything is served (SPEC §17): the format is the
registry's, each tensor's dtype is one stfs knows (safetensors', or one its format declares), its byte count is its
shape times its dtype's size, and its bytes lie inside its file. A format that breaks one has a bug: the message
says so, naming the format, the file and the tensor, never the file as the culprit.

What it cannot check: that the bytes a range names are the tensor's (a format reading the wrong offset inside the
file), that a gathered tensor's pieces beyond its span are where the format says (a DCP's other chunks: each is read
through the format's own ``Read``), or a tensor's bytes in another file (``model`` checks those, as the user's file).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import errors
from .base import DType, Format, Header, TensorEntry
from .dtypes import standard


def check_header(known: Format, registered: str, header: Header, size_of: Callable[[str], int | None]) -> None:
    """Raise ``errors.FormatBug`` where ``header``, as ``known`` (listed in ``REGISTRY`` as ``registered``) returned
    it, breaks what every format promises; ``size_of(file)``: the size of another file of its folder, if known."""
    where = f"{header.path}: stfs's {known.title or registered} reader (stfs/formats/{registered})"
    if known.name != registered:
        raise errors.FormatBug(f"{where} calls itself {known.name!r} but REGISTRY lists it as {registered!r}")
    dtypes: dict[str, DType | None] = {}
    seen: set[str] = set()
    for entry in header.tensors:
        if entry.dtype not in dtypes:
            dtypes[entry.dtype] = standard(entry.dtype) or known.dtype(entry.dtype)
        problem = _problem(entry, dtypes[entry.dtype], header, size_of)
        if problem is None and entry.name in seen:
            problem = "a name an earlier tensor has"
        if problem is not None:
            raise errors.FormatBug(f"{where} returned tensor {entry.name!r} with {problem}")
        seen.add(entry.name)
    for key, value in header.metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise errors.FormatBug(f"{where} returned metadata {key!r}: {value!r:.60}, which is not a string")


def _problem(
    entry: TensorEntry, dtype: DType | None, header: Header, size_of: Callable[[str], int | None]
) -> str | None:
    """What is wrong with ``entry`` (``dtype`` its ``DType``, ``None`` for an unknown name), or ``None``."""
    if dtype is None:
        return f"dtype {entry.dtype!r}, which is neither safetensors' nor one its format declares (Format.dtype)"
    if any(not isinstance(length, int) or length < 0 for length in entry.shape):
        return f"shape {list(entry.shape)}, which is not of non-negative integers"
    count = 1
    for length in entry.shape:
        count *= length
    if count % dtype.group_values:
        return f"{count} values of {entry.dtype}, which packs them {dtype.group_values} to a group"
    nbytes = count // dtype.group_values * dtype.group_bytes
    if entry.begin < 0 or entry.end - entry.begin != nbytes:
        return (
            f"bytes [{entry.begin}, {entry.end}), {entry.end - entry.begin} of them, but shape {list(entry.shape)} of"
            f" {entry.dtype} is {nbytes} bytes (end must be begin + bytes, a gathered tensor's too)"
        )
    scattered = entry.scattered
    if scattered is not None:  # its bytes in C order are gathered from its span, not read from begin..end
        start, length = scattered.span
        first, last, what = start, start + length, "its span"
    else:
        first, last, what = header.data_start + entry.begin, header.data_start + entry.end, "bytes"
    # a range of another file is the user's file to hold (``model``: DataFileTooShort); a span there the format reads
    size = header.file_size if entry.file is None else size_of(entry.file) if scattered is not None else None
    if size is not None and nbytes and (first < 0 or last > size):
        named = "its file" if entry.file is None else repr(entry.file)
        return f"{what} [{first}, {last}) past the end of {named}, which is {size} bytes"
    return None
