"""A container image's layers applied in order into one tree (SPEC §14a); no I/O.

As the OCI image spec's changesets say: a layer's whiteouts apply to the layers below it (``.wh.NAME`` removes
NAME, ``.wh..wh..opq`` empties its folder), then its members are put in place; a hard link is its target's bytes;
a symbolic link is resolved inside the image (``/`` and ``..`` stop at the image's root, as in a chroot), never
out of it, and shows as what it names. The tree is nested dicts, so a whiteout costs one lookup, not a walk.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .mapped import Piece
from .tar_index import Entry

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_HOPS = 40  # symbolic links followed for one name, as Linux's ELOOP
SHOWN = 200  # characters of a name a warning shows
PATH_MAX = 4096  # a link's target, a name looked up: longer ones name nothing
MAX_FILES = 1_000_000  # files the tree gives, links to folders included
MODELS = "models"  # KServe's modelcar convention: the model is under /models


@dataclass(frozen=True, slots=True)
class Symlink:
    target: str


Node = Piece | Symlink | dict  # a file, a link, a folder (name -> Node)


class ImageError(ValueError):
    """The layers do not make a tree stfs can show (the message says why)."""


def image_files(
    layers: Iterable[tuple[str, list[Entry], Callable[[Entry], Piece]]], warn: Callable[[str], None]
) -> tuple[dict[str, Piece], str | None]:
    """The files of the image whose layers are ``(digest, members, piece of a file member)``, bottom first, by path
    from the image's root; and ``models`` where the image has that folder (the model is looked for there)."""
    root: dict = {}
    for digest, members, piece_of in layers:
        placed = []
        for entry in members:
            path = _normal(entry.path)
            if path is None:
                warn(f"layer {digest}: member {_shown(entry.path)!r} is not a path inside the image: left out")
                continue
            parent, _, name = path.rpartition("/")
            if name == OPAQUE:
                folder = _folder(root, parent, make=False)
                if folder is not None:
                    folder.clear()
            elif name.startswith(WHITEOUT):
                folder = _folder(root, parent, make=False)
                if folder is not None:
                    folder.pop(name[len(WHITEOUT) :], None)
            else:
                placed.append((path, entry))
        for path, entry in placed:
            _place(root, path, entry, piece_of, digest, warn)
    files: dict[str, Piece] = {}
    _flatten(root, root, "", "", files, warn, frozenset())
    return files, MODELS if isinstance(_lookup(root, MODELS)[0], dict) else None


def _normal(name: str) -> str | None:
    """A member's path as a path from the image's root; ``None`` for an absolute one or one that leaves it."""
    if name.startswith("/") or "\0" in name:
        return None
    normal = posixpath.normpath(name)
    if normal in (".", "..") or normal.startswith("../"):
        return None
    return normal


def _folder(root: dict, path: str, make: bool) -> dict | None:
    """The folder at ``path`` (``""``: the root); with ``make``, made where missing (a file in the way replaced, as
    a later layer's folder replaces it)."""
    folder = root
    for part in path.split("/") if path else ():
        child = folder.get(part)
        if not isinstance(child, dict):
            if not make:
                return None
            child = folder[part] = {}
        folder = child
    return folder


def _place(
    root: dict, path: str, entry: Entry, piece_of: Callable[[Entry], Piece], digest: str, warn: Callable[[str], None]
) -> None:
    parent, _, name = path.rpartition("/")
    folder = _folder(root, parent, make=True)
    assert folder is not None
    if entry.kind == "folder":
        if not isinstance(folder.get(name), dict):
            folder[name] = {}
    elif entry.kind == "file":
        folder[name] = piece_of(entry)
    elif entry.kind == "symlink":
        folder[name] = Symlink(entry.target)
    elif entry.kind == "hardlink":
        target = _normal(entry.target)
        found = _lookup(root, target, follow_last=False)[0] if target is not None else None
        if isinstance(found, Piece):
            folder[name] = found
        else:
            warn(
                f"layer {digest}: hard link {_shown(entry.path)!r} names {_shown(entry.target)!r}, no file of the "
                "image: left out"
            )


def _lookup(root: dict, path: str, follow_last: bool = True) -> tuple[Node | None, str]:
    """The node at ``path`` from the image's root, symbolic links followed inside the image, and its own path there
    (links resolved); ``None`` if there is none."""
    if len(path) > PATH_MAX:
        return None, ""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    parts.reverse()  # popped from the end
    walked: list[tuple[str, dict]] = []  # the folders gone through: (name, folder)
    node: Node = root
    hops = 0
    while parts:
        part = parts.pop()
        if part == "..":
            if walked:  # the root's parent is the root
                walked.pop()
            node = walked[-1][1] if walked else root
            continue
        if not isinstance(node, dict):
            return None, ""
        child = node.get(part)
        if isinstance(child, Symlink) and (parts or follow_last):
            hops += 1
            if hops > MAX_HOPS or len(child.target) > PATH_MAX:
                return None, ""
            if child.target.startswith("/"):
                walked, node = [], root
            parts += reversed([p for p in child.target.split("/") if p not in ("", ".")])
            continue
        if child is None:
            return None, ""
        node = child
        walked.append((part, child if isinstance(child, dict) else {}))
    return node, "/".join(name for name, _ in walked)


def _flatten(
    root: dict,
    folder: dict,
    where: str,
    prefix: str,
    files: dict[str, Piece],
    warn: Callable[[str], None],
    seen: frozenset[int],
) -> None:
    """``folder`` (at ``where`` in the image)'s files into ``files`` below ``prefix``, links resolved; a folder
    reached again through a link inside itself is left out (a loop)."""
    seen = seen | {id(folder)}
    for name, node in sorted(folder.items()):
        path = f"{prefix}{name}"
        place = f"{where}/{name}" if where else name
        if isinstance(node, Symlink):
            target = node.target if node.target.startswith("/") else f"{where}/{node.target}"
            resolved, place = _lookup(root, target)
            if resolved is None:
                warn(f"symbolic link {path!r} -> {_shown(node.target)!r} names nothing inside the image: left out")
                continue
            node = resolved
        if isinstance(node, dict):
            if id(node) in seen:
                warn(f"symbolic link {path!r} makes a loop: left out")
                continue
            _flatten(root, node, place, path + "/", files, warn, seen)
        elif isinstance(node, Piece):
            if len(files) >= MAX_FILES:
                raise ImageError(f"more than {MAX_FILES} files")
            files[path] = node


def _shown(name: str) -> str:
    """A name as a warning shows it: a hostile one can be megabytes long."""
    return name if len(name) <= SHOWN else name[:SHOWN] + "…"
