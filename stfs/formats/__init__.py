"""Formats: how the bytes of one source file become validated tensors and metadata (a ``Header``).

A format is one module of this package whose ``FORMAT`` (a ``Format``) says everything the rest of stfs needs:
how its files are recognised (their names in a folder, a sniff of their first bytes), how its header is read
into tensors (each one range of its file, or ``TensorEntry.scattered``; a format may read other files of the
folder, ``fetch.folder``: a DCP's ``.metadata`` names its ``.distcp`` files), the dtypes it adds, how the files of a
split set merge, and its name in ``--view safetensors``. ``REGISTRY`` lists the formats; nothing outside this
package names one. Modules are imported when a file of theirs is met (the ``gguf`` package takes a fifth of a
second to import; ONNX models are read without the ``onnx`` package, which takes two).
"""

from __future__ import annotations

import importlib
from functools import cache

from .. import errors
from .base import DType, Folder, Format, Header, RangeFetcher, Rows, Scattered, SplitSet, TensorEntry, encodable
from .dtypes import standard
from .seam import check_header

__all__ = [
    "INDEX_SUFFIXES",
    "MODEL_SUFFIXES",
    "REGISTRY",
    "DType",
    "Folder",
    "Format",
    "Header",
    "RangeFetcher",
    "Rows",
    "Scattered",
    "SplitSet",
    "TensorEntry",
    "claiming",
    "dtype",
    "encodable",
    "groups",
    "identify",
    "indexing",
    "named",
    "read_with",
]

# Each format: its module here, the file names it claims in a folder, and the names of its index files (a JSON
# ``weight_map`` of tensor -> shard file, as transformers writes it).
#
# The order is the order of ``identify``'s sniffs (a file whose name no format claims: the first format whose
# ``sniff`` accepts its first bytes reads it), and of the formats a message lists. A sniff accepts only what its
# format's writer makes: two formats whose files are zips (a torch.save archive, NumPy's .npz) each look at the
# first entry's name (``zip.first_member``), not at the zip's signature alone, so either may come first. A new
# format goes at the end unless its sniff is narrower than one before it.
REGISTRY: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("safetensors", (".safetensors",), (".safetensors.index.json",)),
    ("gguf", (".gguf",), ()),
    ("pytorch", (".bin", ".pt", ".pth", ".ckpt"), (".bin.index.json",)),
    ("onnx", (".onnx",), ()),
    ("dcp", (".metadata",), ()),  # a folder's .metadata: a torch.distributed.checkpoint, its .distcp files beside it
    ("npz", (".npz", ".npy"), ()),
    ("flax", (".msgpack",), (".msgpack.index.json",)),
    ("deepspeed", ("_model_states.pt", "latest"), ()),  # a ZeRO run's tag folder, or the folder whose latest names it
    ("hdf5", (".h5", ".hdf5", ".keras"), ()),  # .weights.h5 too; a .keras is a zip holding model.weights.h5
)
MODEL_SUFFIXES = tuple(suffix for _, suffixes, _ in REGISTRY for suffix in suffixes)
INDEX_SUFFIXES = tuple(suffix for _, _, indexes in REGISTRY for suffix in indexes)


@cache
def named(name: str) -> Format:
    """The format called ``name`` (``Header.format``)."""
    if name not in {module for module, _, _ in REGISTRY}:
        raise KeyError(name)
    found: Format = importlib.import_module(f"{__name__}.{name}").FORMAT
    return found


def claiming(file_name: str) -> Format | None:
    """The format whose files are named like ``file_name`` (``x.gguf``); ``None`` where no format claims it. Of two
    that claim it, the one whose suffix is longer (``mp_rank_00_model_states.pt``: DeepSpeed's, not any ``.pt``)."""
    found = [
        (len(suffix), module) for module, suffixes, _ in REGISTRY for suffix in suffixes if file_name.endswith(suffix)
    ]
    return named(max(found, key=lambda claim: claim[0])[1]) if found else None


def indexing(file_name: str) -> Format | None:
    """The format whose index files are named like ``file_name`` (``x.msgpack.index.json``); ``None`` where none."""
    for module, _, indexes in REGISTRY:
        if indexes and file_name.endswith(indexes):
            return named(module)
    return None


def identify(path: str, fetch: RangeFetcher, file_size: int) -> Format:
    """The format of the file ``path``: the one its name claims (whose reader then names the rule a broken file
    breaks), else the one its first bytes are; ``UnknownFormat`` naming the formats stfs reads otherwise."""
    claimed = claiming(path.rpartition("/")[2])
    if claimed is not None:
        return claimed
    every = [named(module) for module, _, _ in REGISTRY]
    head = fetch(0, min(file_size, max(known.head_size for known in every))) if file_size else b""
    for known in every:
        if known.sniff(head):
            return known
    titles = [known.title for known in every]
    reads = ", ".join(titles[:-1]) + " or " + titles[-1]
    raise errors.UnknownFormat(f"{path}: not a model stfs reads (a {reads} file): its first bytes are {head[:8]!r}")


_SET_NAMESPACE = TensorEntry.__dict__["namespace"].__set__


def read_with(
    known: Format, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
) -> Header:
    """The header of the file ``path`` as the format ``known`` reads it (``Format.read_header``), named after it:
    ``Header.format`` and each tensor's xattr namespace are ``known.name``, whatever the format's own code says; checked
    (``seam.check_header``): a header that breaks what every format promises is ``errors.FormatBug``."""
    header = known.read_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)
    folder = getattr(fetch, "folder", None)
    check_header(known, _registered(known, path), header, folder.size if folder is not None else lambda file: None)
    object.__setattr__(header, "format", known.name)  # a Header is frozen for everyone but the seam that made it
    for entry in (*header.tensors, *(entry for entries in header.folders.values() for entry in entries)):
        _SET_NAMESPACE(entry, known.name)
    return header


def _registered(known: Format, path: str) -> str:
    """The name ``REGISTRY`` lists ``known`` under (its ``name``, unless the format is wrong about it)."""
    names = [module for module, _, _ in REGISTRY]
    if known.name in names and named(known.name) is known:
        return known.name
    for module in names:
        if named(module) is known:
            return module
    raise errors.FormatBug(f"{path}: stfs's {known.title or known.name} reader is not in formats.REGISTRY")


@cache
def dtype(name: str) -> DType:
    """The ``DType`` called ``name``: one of safetensors', or one a format adds; ``KeyError`` for an unknown name."""
    found = standard(name)
    for module, _, _ in REGISTRY:
        if found is None:
            found = named(module).dtype(name)
    if found is None:
        raise KeyError(name)
    return found


def groups(name: str) -> tuple[int, int]:
    """(values, bytes) of the smallest whole group of dtype ``name``'s values: F4 two values a byte, F6 four in
    three bytes, every other dtype of safetensors one value in its own bytes; a GGML type its block."""
    found = dtype(name)
    return found.group_values, found.group_bytes
