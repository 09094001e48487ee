"""Keras 3's ``.keras`` files: a zip of stored members, ``metadata.json``, ``config.json`` and ``model.weights.h5``,
read in place (``formats.zip``): the weights' tensors where the member's bytes lie in the zip, both JSON files in
``metadata/`` as they are."""

from __future__ import annotations

from .. import zip as zipfile
from ..base import RangeFetcher, read_exact
from .datasets import Hdf5Entry
from .file import read_hdf5
from .io import Reader
from .rules import BadStructure, Hdf5Error, UnsupportedStorage

WEIGHTS = "model.weights.h5"
TEXTS = ("config.json", "metadata.json")
MAX_TEXT = 64 << 20  # bytes of config.json or metadata.json kept in metadata/


class KerasZip(Hdf5Error):
    """A ``.keras`` file whose zip is broken, whose members are compressed, or that lacks ``model.weights.h5``."""

    rule_text = "Keras archive"


WORDS: zipfile.Words = {
    zipfile.EntryNotStored: lambda path, detail: UnsupportedStorage(
        path, f"{detail}: a .keras file whose members are compressed is not read in place; Keras saves them stored"
    ),
    zipfile.ZipError: KerasZip,
}


def read_keras(fetch: RangeFetcher, path: str, file_size: int) -> tuple[list[Hdf5Entry], dict[str, str], list[str]]:
    """The tensors of a ``.keras`` file's ``model.weights.h5`` (absolute in the zip), ``metadata/`` (the weights'
    attributes, ``config.json`` and ``metadata.json``), warnings."""
    many = getattr(fetch, "many", None) or (lambda ranges: [fetch(offset, size) for offset, size in ranges])
    with zipfile.reworded(path, WORDS):
        entries, cd_start = zipfile.directory(fetch, file_size, path)
        named = {entry.name: entry for entry in entries}
        if WEIGHTS not in named:
            raise KerasZip(path, f"it holds no {WEIGHTS}: not a Keras 3 model with weights")
        wanted = [named[WEIGHTS], *(named[name] for name in TEXTS if name in named)]
        for entry in wanted:
            zipfile.check_stored(entry, path)
        want = [0, *(min(entry.size, MAX_TEXT) for entry in wanted[1:])]
        placed = zipfile.local_headers(
            fetch, many, wanted, want, zipfile.next_headers(wanted, entries, cd_start), cd_start, path
        )
    start = placed[0][0]
    reader = Reader(fetch, path, start, wanted[0].size)
    tensors, metadata, warnings = read_hdf5(reader)
    for entry, (offset, data) in zip(wanted[1:], placed[1:], strict=True):
        text = bytes(data) if len(data) == entry.size else read_exact(fetch, offset, min(entry.size, MAX_TEXT), path)
        try:
            metadata[entry.name] = text.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError:
            raise BadStructure(path, f"its {entry.name} is not UTF-8") from None
    return tensors, metadata, warnings
