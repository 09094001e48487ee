"""Formats with the mistakes a contributor makes (issue #52), registered in ``formats.REGISTRY`` in this process as a
format module would be: each reads a file through a real format's reader and returns its header with one mistake,
for the seam (``formats.seam``) to catch. ``python3 -m tests.broken_formats MISTAKE stfs ARGS...`` runs the stfs
command line with the broken format ``MISTAKE`` registered (claiming ``.broken`` files), as a user would meet it."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from stfs import formats
from stfs.formats import Format, Header, RangeFetcher

SUFFIX = ".broken"


def _bfloat16(header: Header) -> Header:
    """A dtype spelled as its writer spells it ("bfloat16"), not as safetensors does ("BF16")."""
    return replace(header, tensors=tuple(replace(entry, dtype="bfloat16") for entry in header.tensors))


def _gathered_end(header: Header) -> Header:
    """A gathered tensor's ``end`` not ``begin`` + its bytes (its span's end, say)."""
    return replace(
        header,
        tensors=tuple(
            replace(entry, end=entry.end + 36) if entry.scattered is not None else entry for entry in header.tensors
        ),
    )


def _past_the_end(header: Header) -> Header:
    """The last tensor's range moved past the end of its file."""
    *first, last = header.tensors
    shift = header.file_size - header.data_start - last.begin - 4
    return replace(header, tensors=(*first, replace(last, begin=last.begin + shift, end=last.end + shift)))


def _as_is(header: Header) -> Header:
    return header


# mistake -> (the real format it reads through, what it gets wrong, the name it calls itself)
MISTAKES: dict[str, tuple[str, Callable[[Header], Header], str]] = {
    "dtype": ("safetensors", _bfloat16, "broken"),
    "gathered": ("npz", _gathered_end, "broken"),  # a Fortran-order array of an .npz: a gathered tensor
    "past-the-end": ("safetensors", _past_the_end, "broken"),
    "name": ("safetensors", _as_is, "brokenformat"),  # its name is not the one REGISTRY lists it under
    "none": ("safetensors", _as_is, "broken"),  # no mistake: what the seam lets through
}


class Broken(Format):
    """A real format's reader with one of ``MISTAKES``."""

    title = "Broken"

    def __init__(self, mistake: str) -> None:
        self.real, self.mistake, self.name = MISTAKES[mistake]

    def sniff(self, head: bytes) -> bool:
        return False

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        header = formats.named(self.real).read_header(
            fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read
        )
        return self.mistake(header)


@contextmanager
def registered(format: Format, name: str = "broken", suffixes: tuple[str, ...] = (SUFFIX,)) -> Iterator[Format]:
    """``format`` listed in ``formats.REGISTRY`` as ``name`` (its module ``stfs.formats.NAME``) while within."""
    module = types.ModuleType(f"stfs.formats.{name}")
    module.FORMAT = format  # type: ignore[attr-defined]
    saved = formats.REGISTRY
    sys.modules[module.__name__] = module
    formats.REGISTRY = (*saved, (name, suffixes, ()))
    formats.named.cache_clear()
    try:
        yield format
    finally:
        formats.REGISTRY = saved
        del sys.modules[module.__name__]
        formats.named.cache_clear()


def main(argv: list[str]) -> int:
    from stfs.cli import main as stfs_main

    mistake, _, *args = argv
    with registered(Broken(mistake)):
        return stfs_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
