"""The mounted tree: names to paths (escaping, collisions, implicit folders) and path lookup.

Built once from validated models; it never changes afterwards. ``lookup()``
and ``listdir()`` return ``None`` on a miss; only the FUSE layer speaks errno.

Escaping (README.md, "Names and paths"), for a tensor name, metadata key or shard name:

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
import json
import re
import stat
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from sys import intern

from .errors import TreeError
from .format import TensorEntry
from .model import Model, merged_header

NAME_MAX = 255
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444
SELF_NAME = "%"  # a folder's own tensor, or the empty name at the root
_SPLIT = re.compile(r"(?<=[^.])\.(?=[^.])")
_ESCAPE = re.compile(r"[%/\x00]")
_UNESCAPE = re.compile(r"%([0-9A-F]{2})")


class FileNode:
    """A file: ``size`` bytes of ``file`` at ``offset``, or ``data`` held in memory.

    A tensor's file also keeps its ``TensorEntry``; its extended attributes are made from
    that when asked for (100,000 tensors would otherwise hold 500,000 small ``bytes``).
    A plain slotted class: one is made per tensor, and a dataclass would be slower to build.
    """

    __slots__ = ("inode", "mtime_ns", "size", "file", "offset", "data", "tensor")

    def __init__(self, inode: int, mtime_ns: int, size: int, file: str | None = None, offset: int = 0,
                 data: bytes | None = None, tensor: TensorEntry | None = None) -> None:
        self.inode = inode
        self.mtime_ns = mtime_ns
        self.size = size
        self.file = file
        self.offset = offset
        self.data = data
        self.tensor = tensor

    @property
    def xattrs(self) -> dict[str, bytes]:
        tensor = self.tensor
        if tensor is None or self.file is None:
            return {}
        return _xattrs(tensor.name, tensor.dtype, tensor.shape, self.file, self.offset)

    def __repr__(self) -> str:
        return f"FileNode(inode={self.inode}, size={self.size}, file={self.file!r}, offset={self.offset})"


class DirNode:
    """A folder: its entries by (escaped) name, in the order they were made."""

    __slots__ = ("inode", "mtime_ns", "children", "parent")

    def __init__(self, inode: int, mtime_ns: int, parent: DirNode | None = None) -> None:
        self.inode = inode
        self.mtime_ns = mtime_ns
        self.children: dict[str, FileNode | DirNode] = {}
        self.parent = self if parent is None else parent  # the root is its own parent, as "/.." is "/"

    def __repr__(self) -> str:
        return f"DirNode(inode={self.inode}, entries={len(self.children)})"


Node = FileNode | DirNode


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
        not name or "%" in name or "/" in name or "\x00" in name or ".." in name
        or name[0] == "." or name[-1] == "."
    )


def join_path(components: Iterable[str]) -> str:
    """The tensor name a nested path stands for (inverse of ``split_name``)."""
    return ".".join(unescape_component(c) for c in components)


class Tree:
    """An immutable tree of folders and files; lookup walks the path's components from the root.

    No table of whole paths: 100,000 tensors under 120,000 folders would keep 220,000 path
    strings for lookups that cost a few dict probes anyway.
    """

    def __init__(self, mtime_ns: int) -> None:
        self._next_inode = 1
        self.root = DirNode(inode=self._take_inode(), mtime_ns=mtime_ns)
        self.data_size = 0
        self.file_count = 0

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

    def add_file(self, components: list[str], node: FileNode) -> None:
        """Place ``node`` at ``components``; the last one is its file name."""
        parent = self.folder(components[:-1], node.mtime_ns)
        name = components[-1]
        if name in parent.children:
            raise TreeError(f"/{'/'.join(components)} is taken twice")
        parent.children[name] = node
        self.file_count += 1

    def add_tensor(self, folder: DirNode, components: list[str], node: FileNode) -> None:
        """Place a tensor's file at ``components`` below ``folder``.

        A tensor whose path is also a folder (``a.b`` next to ``a.b.c``) is the file ``%``
        inside that folder, whichever of the two comes first.
        """
        self.place_tensor(self.tensor_folder(folder, components[:-1], node.mtime_ns), components[-1], node)

    def tensor_folder(self, folder: DirNode, components: list[str], mtime_ns: int) -> DirNode:
        """The folder at ``components`` below ``folder``, made if missing; a tensor's file in the way moves in."""
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

    def place_tensor(self, parent: DirNode, name: str, node: FileNode) -> None:
        """Put a tensor's file in ``parent`` as ``name``, or as ``name/%`` if ``name`` is a folder."""
        child = parent.children.get(name)
        if child is None:
            parent.children[name] = node
        elif type(child) is DirNode and SELF_NAME not in child.children:
            child.children[SELF_NAME] = node
        else:
            raise TreeError(f"tensor file {name!r} is taken twice")
        self.file_count += 1

    def new_file(self, mtime_ns: int, size: int, file: str | None = None, offset: int = 0,
                 data: bytes | None = None) -> FileNode:
        """A file that is ``size`` bytes of ``file`` at ``offset``, or ``data`` held in memory."""
        return FileNode(self._take_inode(), mtime_ns, size, file, offset, data)

    def new_memory_file(self, mtime_ns: int, data: bytes) -> FileNode:
        return self.new_file(mtime_ns, len(data), data=data)

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


def build_tree(models: list[Model], layout: str = "nested") -> Tree:
    """The whole mount: one model at the root, or one folder per model (SPEC §1-§2)."""
    mtime = max((shard.header.mtime_ns for model in models for shard in model.shards), default=0)
    tree = Tree(mtime_ns=mtime)
    for model in models:
        base = model.name.split("/") if model.name else []
        try:
            _add_model(tree, base, model, layout)
        except TreeError as exc:
            raise TreeError(f"{model.path}: {exc}") from None
        tree.data_size += model.data_size
    return tree


def _add_model(tree: Tree, base: list[str], model: Model, layout: str) -> None:
    model_mtime = max(shard.header.mtime_ns for shard in model.shards)
    tree.folder(base, model_mtime)
    if model.is_sharded:
        header_file = tree.new_memory_file(model_mtime, merged_header(model))
    else:
        header = model.shards[0].header
        header_file = tree.new_file(model_mtime, header.json_length, header.path, offset=8)
    tree.add_file([*base, "header.json"], header_file)
    _add_metadata(tree, [*base, "metadata"], model.metadata, model_mtime)
    _add_tensors(tree, tree.folder([*base, "tensors"], model_mtime), layout, model)
    if model.index_path is not None:
        with open(model.index_path, "rb") as stream:
            tree.add_file([*base, "index.json"], tree.new_memory_file(model_mtime, stream.read()))
        tree.folder([*base, "shards"], model_mtime)
        for shard in model.shards:
            header = shard.header
            folder = [*base, "shards", escape_component(shard.name)]
            tree.folder(folder, header.mtime_ns)
            shard_header = tree.new_file(header.mtime_ns, header.json_length, header.path, offset=8)
            tree.add_file([*folder, "header.json"], shard_header)
            _add_metadata(tree, [*folder, "metadata"], header.metadata, header.mtime_ns)


def _add_metadata(tree: Tree, folder: list[str], metadata: Mapping[str, str], mtime_ns: int) -> None:
    tree.folder(folder, mtime_ns)
    for key, value in metadata.items():
        content = (value + "\n").encode("utf-8", "surrogatepass")
        tree.add_file([*folder, escape_component(key)], tree.new_memory_file(mtime_ns, content))


def _add_tensors(tree: Tree, folder: DirNode, layout: str, model: Model) -> None:
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
            found = folders[known] = tree.tensor_folder(found, [_component(last)], mtime_ns)
        return found

    placed = 0
    for shard in model.shards:
        header = shard.header
        file, start, mtime = header.path, header.data_start, header.mtime_ns
        for entry in header.tensors:  # the hot loop of a mount: calls inlined
            name = entry.name
            inode = tree._next_inode
            tree._next_inode = inode + 1
            node = FileNode(inode, mtime, entry.end - entry.begin, file, start + entry.begin, None, entry)
            if nested and _plain(name):
                prefix, _, leaf = name.rpartition(".")
                parent = folders.get(prefix)
                if parent is None:
                    parent = folder_of(prefix, mtime)
                leaf = _component(leaf)
                if leaf in parent.children:
                    tree.place_tensor(parent, leaf, node)  # a folder of that name: the file goes in as "%"
                else:
                    parent.children[leaf] = node
                    placed += 1
            else:
                tree.add_tensor(folder, split_name(name, layout), node)
    tree.file_count += placed


def _component(part: str) -> str:
    """A piece of a plain name (``_plain``) as a path component."""
    return intern(part) if len(part) <= _SHORT else escape_component(part)


def _xattrs(name: str, dtype: str, shape: tuple[int, ...], file: str, offset: int) -> dict[str, bytes]:
    """The ``user.safetensors.*`` extended attributes of a tensor file (SPEC §2)."""
    return {
        "user.safetensors.name": name.encode("utf-8", "surrogatepass"),
        "user.safetensors.dtype": dtype.encode(),
        "user.safetensors.shape": json.dumps(list(shape), separators=(",", ":")).encode(),
        "user.safetensors.file": file.encode("utf-8", "surrogateescape"),
        "user.safetensors.offset": str(offset).encode(),
    }


def file_mode(node: Node) -> int:
    return DIR_MODE if isinstance(node, DirNode) else FILE_MODE
