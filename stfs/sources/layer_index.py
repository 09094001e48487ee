"""What a compressed tar layer's pass found, kept in ``--cache-dir`` by the blob's digest so a later mount makes none.

One file per blob, ``DIR/FOLDER/<digest>.index``: a line of JSON (the format, the blob's size, the tar's members,
whatever the layer adds: a zstd layer's frames) then, after it, the layer's own bytes (a gzip layer's zran index),
their SHA-256 in the JSON. The file is one of ``DiskCache``'s kept files: counted in ``--cache-dir-size`` and
deleted least recently used first, then made again by the next pass. Content addressed, it never goes stale; one
that does not read back whole is said, deleted and made again.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .disk_cache import DiskCache
from .tar_index import Entry

FORMAT = 2  # 1: a gzip index in two files (.zran, .json); those left are deleted with the pieces, oldest first


def kept_name(folder: str, digest: str, suffix: str) -> str:
    """The name in ``--cache-dir`` of what a layer of blob ``digest`` keeps in ``folder``."""
    return f"{folder}/{digest.replace(':', '-')}{suffix}"


def save(disk: DiskCache, name: str, size: int, found: list[Entry], fields: dict[str, Any], data: bytes = b"") -> None:
    """Keep the members ``found`` in the blob of ``size`` bytes, ``fields`` and ``data`` as ``name``."""
    head = {
        "format": FORMAT,
        "size": size,
        "data_sha256": hashlib.sha256(data).hexdigest(),
        "entries": [[e.path, e.kind, e.offset, e.size, e.mtime, e.target] for e in found],
        **fields,
    }
    disk.write_file(name, json.dumps(head, separators=(",", ":")).encode() + b"\n" + data)


def load(disk: DiskCache, name: str, size: int) -> tuple[list[Entry], dict[str, Any], bytes] | None:
    """The members, fields and data kept as ``name`` for the blob of ``size`` bytes; ``None`` where none is kept; a
    ``ValueError`` saying why where the one kept is not whole (it is deleted: the next pass keeps another)."""
    file = disk.open_file(name)
    if file is None:
        return None
    with file:
        kept = file.read()
    try:
        line, _, data = kept.partition(b"\n")
        head = json.loads(line)
        if head.get("format") != FORMAT or head.get("size") != size:
            raise ValueError("it is not the one made for it")
        if head.get("data_sha256") != hashlib.sha256(data).hexdigest():
            raise ValueError("its bytes are not those it was kept with")
        found = [Entry(str(p), str(k), int(o), int(n), float(t), str(g)) for p, k, o, n, t, g in head["entries"]]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        disk.drop_file(name)
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return found, head, data
