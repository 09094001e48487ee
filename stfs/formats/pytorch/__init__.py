"""PyTorch checkpoints (``torch.save``), read without running them (SPEC §12).

Pure: bytes come through ``read(offset, size)``, no I/O of its own, and nothing the checkpoint names is
imported, resolved or called. The pickle is interpreted by stfs, one loop over its opcodes, into plain values:
``GLOBAL`` and ``STACK_GLOBAL`` push a name and nothing more; a call (``REDUCE``, ``NEWOBJ``) of the names
torch's own loader uses to rebuild tensors becomes a tensor description, a call of anything else an opaque
record of the name and its arguments; ``BUILD`` and persistent ids are data. Work and memory are bounded
(``MAX_*``): past a bound the file is refused as invalid input.

Two layouts, as ``torch.serialization`` writes them:

* the zip archive (torch >= 1.6): stored entries under one top folder — ``data.pkl``, ``byteorder``, one
  ``data/KEY`` per storage. Only the end records, the central directory, ``data.pkl``, ``byteorder`` and
  the local headers of the storages that reachable tensors use are read; never a storage's bytes;
* the format before it (``_use_new_zipfile_serialization=False``): five pickles (magic number, protocol,
  sys_info, the object, the storage keys), then each storage, in the order of the keys, as an int64
  element count and its bytes; every storage's offset follows from the pickles (the counts are checked).

The tar format of torch 0.x and TorchScript archives are refused. Learnt from torch's
``_weights_only_unpickler.py`` and ``serialization.py`` and candle's ``pickle.rs``; a copy of neither.

One job a module, in the order the bytes flow (through ``formats.base``'s ``read_exact`` and ``formats.zip``, whose
refusals are worded as a checkpoint's, ``zip_archive.WORDS``): ``unpickler`` (the
opcode loop and its bounds) making ``values`` (names, opaque calls, storages, tensors) through ``calls`` (what
the rebuild functions, storage classes, ``OrderedDict`` mean) and ``allowed`` (torch's dtypes, storage classes
and weights_only allow-list, as data); ``naming`` (the walk naming tensors by their path of keys),
``checkpoint`` (``Tensor``, ``Checkpoint``: each tensor placed in its storage), ``zip_archive`` and ``legacy``
(the two layouts), ``writer`` (the equivalent safetensors file); a strided tensor's bytes are put in C order by
``formats.gather``. This module picks the layout and is the format seam (``fetch_header``).

Choices where SPEC §12 is silent:

* names: a tensor that is the top object itself is named ``""``; keys that are not strings are spelled as
  decimal integers, UTF-8 bytes (backslash escapes), ``repr`` of other scalars, ``<...>`` for anything else;
  two tensors on one name (keys ``1`` and ``"1"``) keep the first, the other left out with a warning;
* an opaque object (a call of a name stfs does not interpret, such as a whole pickled ``nn.Module``) is
  walked through its arguments (by position), its BUILD state (by key), and what SETITEMS and APPENDS gave
  it; BUILD on a dict or list sets attributes (an OrderedDict's ``_metadata``), not contents, and is not
  walked; a cycle is not followed;
* conjugate and negative views (their stored bytes are not their values) are left out with a warning;
* strings and bytes over ``MAX_INLINE`` are skipped unread (a placeholder stays);
* reads: local headers closer than ``COALESCE_GAP`` are read together, with the small storages between them;
  a legacy file's pickles are read in growing windows, the last of which reaches into the first storages;
* stricter than torch.load: a local header naming another entry than the central directory does, a storage
  named with two sizes, an entry twice, a storage size other than the pickle says; a BUILD on a tensor, or a
  tensor's state setting ``real`` or ``imag`` (torch would change the tensor, or copy values into its storage);
* looser: calls torch.load refuses for their arguments (an OrderedDict of two arguments, a rebuild function short
  of its last arguments) are read as far as they go, or kept as opaque calls;
* left out with a warning: a tensor torch converts to another dtype on loading, a Parameter made without data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .. import zip
from ..base import Format, Header, RangeFetcher, Read, ReadMany, Rows, TensorEntry, read_exact
from ..gather import GATHER_ELEMENTS, GATHER_GAP, GATHER_WINDOW, gather_into, strided_layout
from .allowed import DCP_GLOBALS, IMPORT_MAPPING, NAME_MAPPING, STORAGE_DTYPES, TORCH_DTYPES, WEIGHTS_ONLY_GLOBALS
from .calls import MAX_REBUILD_NESTING
from .checkpoint import Checkpoint, LeftOut, Tensor
from .legacy import LEGACY_FIRST_READ, LEGACY_MAGIC, LEGACY_MAGIC_LONG, LEGACY_PROTOCOL, read_legacy
from .naming import MAX_NAME, MAX_NAME_CHARS, MAX_WALK_STEPS
from .rules import LegacyTarCheckpoint, NotACheckpoint
from .unpickler import MAX_INLINE, MAX_LINE, MAX_MEMO, MAX_NESTING, MAX_OPCODES, WINDOW
from .writer import SafetensorsFile, header_json, safetensors_file, safetensors_header
from .zip_archive import WORDS, read_zip, zip_object

__all__ = [
    "DCP_GLOBALS",
    "GATHER_ELEMENTS",
    "GATHER_GAP",
    "GATHER_WINDOW",
    "IMPORT_MAPPING",
    "LEGACY_FIRST_READ",
    "LEGACY_MAGIC",
    "LEGACY_MAGIC_LONG",
    "LEGACY_PROTOCOL",
    "MAX_INLINE",
    "MAX_LINE",
    "MAX_MEMO",
    "MAX_NAME",
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "MAX_OPCODES",
    "MAX_REBUILD_NESTING",
    "MAX_WALK_STEPS",
    "NAME_MAPPING",
    "STORAGE_DTYPES",
    "TORCH_DTYPES",
    "WEIGHTS_ONLY_GLOBALS",
    "WINDOW",
    "Checkpoint",
    "LeftOut",
    "PytorchEntry",
    "SafetensorsFile",
    "Tensor",
    "detect",
    "fetch_header",
    "gather_into",
    "strided_layout",
    "header_json",
    "read_checkpoint",
    "safetensors_file",
    "safetensors_header",
    "unsafe_warnings",
    "zip_object",
]


def detect(head: bytes) -> str | None:
    """``"zip"``, ``"legacy"`` or ``"tar"`` (torch 0.x) from a file's first bytes (512 for tar), else None.

    A zip is any zip here (``read_checkpoint`` tells a checkpoint from another archive).
    """
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        magic = head[11:23] if head[2:3] == b"\x95" else head[2:14]
        if magic == LEGACY_MAGIC_LONG:
            return "legacy"
    if head[257:262] == b"ustar":
        return "tar"
    return None


def read_checkpoint(
    read: RangeFetcher,
    size: int,
    *,
    path: str = "<checkpoint>",
    head: bytes | None = None,
    read_many: ReadMany | None = None,
) -> Checkpoint:
    """Read and validate the checkpoint of ``size`` bytes behind ``read``; refusals raise ``PytorchError``.

    ``head``: the file's first bytes where the caller has them already (a remote source's first read), at
    least 512 of them or the whole file; else they are read. ``read_many``: see ``ReadMany``.
    """
    many = read_many or (lambda ranges: [read(offset, length) for offset, length in ranges])
    with zip.reworded(path, WORDS):
        if head is None or len(head) < min(size, 512):
            head = read_exact(read, 0, min(size, 512), path)
        kind = detect(head)
        if kind == "zip":
            return read_zip(read, many, size, path)
        if kind == "legacy":
            return read_legacy(read, many, size, path, head)
    if kind == "tar":
        raise LegacyTarCheckpoint(path, "the tar format of PyTorch 0.x, which stfs does not read")
    raise NotACheckpoint(path, "neither a torch.save zip archive nor a legacy torch.save file")


@dataclass(frozen=True, slots=True)
class PytorchEntry(TensorEntry):
    """A tensor of a checkpoint: ``begin``/``end`` are absolute offsets in the file (its ``Header`` has
    ``data_start`` 0: a checkpoint's storages are not one data section); its files' xattrs ``user.pytorch.*``.

    ``tensor``: the reader's ``Tensor`` (its storage, strides and offset), where a strided one is gathered from.
    """

    tensor: Tensor | None = None

    @property
    def scattered(self) -> Strided | None:
        return Strided(self.tensor) if self.tensor is not None and not self.tensor.contiguous else None


@dataclass(frozen=True, slots=True)
class Strided:
    """A strided tensor of a checkpoint (a transpose, a slice with a step) as every format's ``Scattered``: its
    elements gathered in C order from its storage."""

    tensor: Tensor

    @property
    def offset(self) -> int:
        return self.tensor.offset

    @property
    def span(self) -> tuple[int, int]:
        return self.tensor.span

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        gather_into(self.tensor, read, begin, view)

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        return strided_layout(self.tensor, limit)


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read and validate the checkpoint ``path`` through ``fetch`` as a ``Header``: its tensors (``begin``/``end``
    absolute: a contiguous one's bytes; a strided one's ``end - begin`` its size in C order, gathered by its
    ``tensor``), ``header.json`` the equivalent safetensors file's JSON, metadata ``{"format": "pt"}``;
    the ``Checkpoint`` itself as ``parsed`` (its globals, for ``check``)."""
    checkpoint = read_checkpoint(fetch, file_size, path=path, read_many=getattr(fetch, "many", None))
    served = checkpoint.tensors
    made = header_json(served)
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tuple(
            PytorchEntry(tensor.name, tensor.dtype, tensor.shape, tensor.offset, tensor.offset + tensor.nbytes, tensor)
            for tensor in served
        ),
        metadata={"format": "pt"},
        digest=hashlib.sha256(made).digest(),
        data_start=0,
        json_made=made,
        parsed=checkpoint,
        warnings=checkpoint.warnings + unsafe_warnings(checkpoint),
        check_problems=unsafe_warnings(checkpoint),
    )


def unsafe_warnings(checkpoint: Checkpoint) -> tuple[str, ...]:
    """One line per global the checkpoint names that ``torch.load(weights_only=True)`` refuses (SPEC §12)."""
    return tuple(
        f"{checkpoint.path}: names the global {name!r}: loading it without weights_only=True would import and call it"
        for name in checkpoint.unsafe_globals
    )


def safetensors_name(path: str) -> str:
    """The name in ``--view safetensors`` of a checkpoint's file or a checkpoints' index (SPEC §12)."""
    folder, _, name = path.rpartition("/")
    if name == "pytorch_model.bin.index.json":
        name = "model.safetensors.index.json"
    elif name.startswith("pytorch_model") and name.endswith(".bin"):
        name = "model" + name[len("pytorch_model") : -len(".bin")] + ".safetensors"
    else:
        name = name[: name.rindex(".")] + ".safetensors"
    return f"{folder}/{name}" if folder else name


TORCH_FIRST = frozenset(("data.pkl", "constants.pkl", "version", ".format_version", "byteorder"))


class _Pytorch(Format):
    name = "pytorch"
    title = "PyTorch checkpoint"
    head_size = 512  # a tar's "ustar" is at 257
    confirm_in_folder = True  # any .bin: a checkpoint only if its first bytes are one's

    def sniff(self, head: bytes) -> bool:
        """Its first bytes: a legacy file's pickle, a torch 0.x tar; a zip only where its first entry is one torch
        writes in its top folder (``archive/data.pkl``; a TorchScript archive's ``data/0``, refused by its rule):
        not any zip."""
        kind = detect(head)
        if kind != "zip":
            return kind is not None
        _, slash, inside = (zip.first_member(head) or "").partition("/")
        return bool(slash) and (inside in TORCH_FIRST or inside.startswith(("data/", "code/")))

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def safetensors_name(self, path: str) -> str | None:
        return safetensors_name(path)


FORMAT: Format = _Pytorch()
