"""The mounted tree: names to paths (escaping, collisions, implicit folders) and path lookup.

Built once (by ``views.build_tree``) and never changed afterwards; it does no I/O. ``lookup()``
and ``listdir()`` return ``None`` on a miss; only the FUSE layer speaks errno.

Escaping (docs/tree.md, "Names and paths"), for a tensor name, metadata key or shard name:

* ``%`` -> ``%25``, ``/`` -> ``%2F``, NUL -> ``%00`` anywhere;
* nested layout: a name is split at each dot that stands between two non-dots
  (``a.b`` -> ``a/b``; ``a..b``, ``.a`` and ``a.`` keep their dots in one component);
* a component ``.`` or ``..`` is written ``%2E`` / ``%2E%2E``;
* a component longer than NAME_MAX (255 bytes) keeps its first 200 bytes and adds
  ``%~`` and a hash of the whole component;
* a tensor whose path is also a folder (``a.b`` next to ``a.b.c``) is the file ``%``
  inside that folder; the empty name is ``%`` in the root of ``tensors/``.
"""

from __future__ import annotations

import hashlib
import re
from collections import deque
from collections.abc import Iterable, Iterator
from sys import intern

from .errors import TreeError
from .formats import TensorEntry
from .nodes import DirNode, FileNode, Node, Segments

NAME_MAX = 255
SELF_NAME = "%"  # a folder's own tensor, or the empty name at the root
_SPLIT = re.compile(r"(?<=[^.])\.(?=[^.])")
_ESCAPE = re.compile(r"[%/\x00]")
_UNESCAPE = re.compile(r"%([0-9A-F]{2})")


def escape_component(component: str) -> str:
    """One path component for a piece of a name (see the module docstring)."""
    escaped = _ESCAPE.sub(lambda m: f"%{ord(m.group()):02X}", component)
    if escaped in (".", ".."):
        escaped = "%2E" * len(escaped)
    if escaped == "":
        return SELF_NAME
    encoded = escaped.encode("utf-8", "surrogatepass")
    if len(encoded) > NAME_MAX:
        digest = hashlib.sha256(encoded).hexdigest()[:32]
        escaped = encoded[:200].decode("utf-8", "ignore") + "%~" + digest
    return escaped


def unescape_component(component: str) -> str:
    """Inverse of ``escape_component`` for components that were not shortened."""
    if component == SELF_NAME:
        return ""
    return _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), component)


def split_name(name: str, layout: str) -> list[str]:
    """The path components of tensor ``name`` under ``layout`` (``nested`` or ``flat``)."""
    if layout == "nested" and _plain(name):
        # The common case, fast: every dot splits and no component needs escaping. Components
        # are interned: "weight" or "12" stand in many folders, as one str.
        return [_component(part) for part in name.split(".")]
    parts = _SPLIT.split(name) if layout == "nested" else [name]
    return [escape_component(part) for part in parts]


_SHORT = NAME_MAX // 4  # a component of this many characters is at most NAME_MAX bytes of UTF-8


def _plain(name: str) -> bool:
    """No character to escape and no dot that would not split (leading, trailing, doubled)."""
    return not (
        not name or "%" in name or "/" in name or "\x00" in name or ".." in name or name[0] == "." or name[-1] == "."
    )


def join_path(components: Iterable[str]) -> str:
    """The tensor name a nested path stands for (inverse of ``split_name``)."""
    return ".".join(unescape_component(c) for c in components)


class Tree:
    """An immutable tree of folders and files; lookup walks the path's components from the root.

    No table of whole paths: 100,000 tensors under 120,000 folders would keep 220,000 path
    strings for lookups that cost a few dict probes anyway. Inodes are handed out in the order
    nodes are made, so the same models give the same inodes on every mount.
    """

    def __init__(self, mtime_ns: int) -> None:
        self._next_inode = 1
        self.root = DirNode(inode=self._take_inode(), mtime_ns=mtime_ns)
        self.data_size = 0
        self.file_count = 0
        self.readahead_kb: dict[int, int] = {}  # files with a kernel readahead of their own (readahead.py), by inode

    @property
    def inode_limit(self) -> int:
        """One more than the highest inode handed out (inodes are dense from 1)."""
        return self._next_inode

    def _take_inode(self) -> int:
        inode = self._next_inode
        self._next_inode += 1
        return inode

    def lookup(self, path: str) -> Node | None:
        """The node at absolute ``path`` ("/a/b"), or ``None``."""
        node: Node = self.root
        if path == "/":
            return node
        for component in path[1:].split("/"):
            if type(node) is not DirNode:
                return None
            found = node.children.get(component)
            if found is None:
                return None
            node = found
        return node

    def listdir(self, path: str) -> list[str] | None:
        """Names in folder ``path``, or ``None`` if it is not a folder."""
        node = self.lookup(path)
        if not isinstance(node, DirNode):
            return None
        return list(node.children)

    def take_inodes(self, count: int) -> range:
        """``count`` inode numbers for files about to be made (``FileNode`` built directly, in a hot loop)."""
        first = self._next_inode
        self._next_inode += count
        return range(first, first + count)

    def new_file(
        self, mtime_ns: int, segments: Segments, tensor: TensorEntry | None = None, view: str | None = None
    ) -> FileNode:
        """A file made of ``segments``, not yet placed; ``tensor`` for a tensor's file (its xattrs)."""
        return FileNode(self._take_inode(), mtime_ns, segments, tensor, view)

    def folder(self, components: list[str], mtime_ns: int) -> DirNode:
        """The folder at ``components``, made (with its parents) if missing."""
        node = self.root
        path = ""
        for component in components:
            path += "/" + component
            child = node.children.get(component)
            if child is None:
                child = DirNode(self._take_inode(), mtime_ns, node)
                node.children[component] = child
            elif isinstance(child, FileNode):
                raise TreeError(f"{path} is both a file and a folder")
            node = child
        return node

    def add_file(self, components: list[str], mtime_ns: int, segments: Segments) -> FileNode:
        """A file of ``segments`` placed at ``components``; the last one is its file name."""
        parent = self.folder(components[:-1], mtime_ns)
        name = components[-1]
        if name in parent.children:
            raise TreeError(f"/{'/'.join(components)} is taken twice")
        node = parent.children[name] = self.new_file(mtime_ns, segments)
        self.file_count += 1
        return node

    def add_named_files(self, folder: DirNode, layout: str, files: Iterable[FileNode], suffix: str = "") -> None:
        """Place each file below ``folder`` at the path of its tensor's name (``node.tensor.name``) under ``layout``.

        ``suffix`` ends each file name (``.npy``). A name whose path is also a folder (``a.b`` next to
        ``a.b.c``) is the file ``%`` inside that folder, whichever of the two comes first.
        """
        # Neighbouring tensors share folders (model.layers.7.mlp.up_proj.weight and .bias): each folder
        # is remembered by its dotted prefix, and a new one is made below the longest prefix known.
        folders: dict[str, DirNode] = {"": folder}
        nested = layout == "nested"

        def folder_of(prefix: str, mtime_ns: int) -> DirNode:
            found = folders.get(prefix)
            missing: list[tuple[str, str]] = []
            while found is None:  # up to the longest prefix known ("" at worst); a loop, as names may be 10,000 deep
                above, _, last = prefix.rpartition(".")
                missing.append((prefix, last))
                prefix = above
                found = folders.get(prefix)
            for known, last in reversed(missing):
                found = folders[known] = self._subfolder(found, [_component(last)], mtime_ns)
            return found

        placed = 0
        for node in files:  # the hot loop of a mount
            name = node.tensor.name  # type: ignore[union-attr]
            if nested and _plain(name):
                prefix, _, leaf = name.rpartition(".")
                parent = folders.get(prefix)
                if parent is None:
                    parent = folder_of(prefix, node.mtime_ns)
                leaf = _component(leaf) + suffix if suffix else _component(leaf)
                if leaf in parent.children:
                    self._place(parent, leaf, node)  # a folder of that name: the file goes in as "%"
                else:
                    parent.children[leaf] = node
                    placed += 1
            else:
                components = split_name(name, layout)
                parent = self._subfolder(folder, components[:-1], node.mtime_ns)
                self._place(parent, components[-1] + suffix, node)
        self.file_count += placed

    def _subfolder(self, folder: DirNode, components: list[str], mtime_ns: int) -> DirNode:
        """The folder at ``components`` below ``folder``, made if missing; a named file in the way moves in."""
        parent = folder
        for component in components:
            child = parent.children.get(component)
            if child is None:
                child = parent.children[component] = DirNode(self._take_inode(), mtime_ns, parent)
            elif type(child) is not DirNode:  # a tensor's file stands where a folder must go: it moves in as "%"
                moved = parent.children[component] = DirNode(self._take_inode(), mtime_ns, parent)
                moved.children[SELF_NAME] = child
                child = moved
            parent = child
        return parent

    def _place(self, parent: DirNode, name: str, node: FileNode) -> None:
        """Put a named file in ``parent`` as ``name``, or as ``name/%`` if ``name`` is a folder."""
        child = parent.children.get(name)
        if child is None:
            parent.children[name] = node
        elif type(child) is DirNode and SELF_NAME not in child.children:
            child.children[SELF_NAME] = node
        else:
            raise TreeError(f"tensor file {name!r} is taken twice")
        self.file_count += 1

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Every (path, node), folders before their contents."""
        yield "/", self.root
        queue: deque[tuple[str, DirNode]] = deque([("", self.root)])
        while queue:
            prefix, folder = queue.popleft()
            for name, child in folder.children.items():
                path = f"{prefix}/{name}"
                yield path, child
                if isinstance(child, DirNode):
                    queue.append((path, child))


def _component(part: str) -> str:
    """A piece of a plain name (``_plain``) as a path component."""
    return intern(part) if len(part) <= _SHORT else escape_component(part)
