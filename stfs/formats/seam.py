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
from math import prod

from .. import errors
from .base import DType, Format, Header, TensorEntry
from .dtypes import standard


def check_header(known: Format, registered: str, header: Header, size_of: Callable[[str], int | None]) -> None:
    """Raise ``errors.FormatBug`` where ``header``, as ``known`` (listed in ``REGISTRY`` as ``registered``) returned
    it, breaks what every format promises; ``size_of(file)``: the size of another file of its folder, if known."""
    where = f"{header.path}: stfs's {known.title or registered} reader (stfs/formats/{registered})"
    if known.name != registered:
        raise errors.FormatBug(f"{where} calls itself {known.name!r} but REGISTRY lists it as {registered!r}")
    groups: dict[str, tuple[int, int] | None] = {}  # dtype -> (values, bytes) of a group, None for an unknown name
    data_start, file_size = header.data_start, header.file_size
    for entry in header.tensors:
        # the common case in few operations (a model may hold 100,000 tensors); anything else is looked at closely
        if entry.dtype not in groups:
            found = standard(entry.dtype) or known.dtype(entry.dtype)
            groups[entry.dtype] = (found.group_values, found.group_bytes) if found is not None else None
        group = groups[entry.dtype]
        shape = entry.shape
        count = prod(shape)
        plain = (
            group is not None
            and type(count) is int
            and count % group[0] == 0
            and entry.end - entry.begin == count // group[0] * group[1]
            and entry.begin >= 0
            and (not shape or min(shape) >= 0)
            and entry.file is None
            and entry.scattered is None
            and data_start + entry.end <= file_size
        )
        problem = None if plain else _problem(entry, standard(entry.dtype) or known.dtype(entry.dtype), header, size_of)
        if problem is not None:
            raise errors.FormatBug(f"{where} returned tensor {entry.name!r} with {problem}")
    names = [entry.name for entry in header.tensors]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise errors.FormatBug(f"{where} returned tensor {name!r} with a name an earlier tensor has")
            seen.add(name)
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
