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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .model import Model, Tensor, merged_header

NAME_MAX = 255
SELF_NAME = "%"  # a folder's own tensor, or the empty name at the root
_SPLIT = re.compile(r"(?<=[^.])\.(?=[^.])")
_ESCAPE = re.compile(r"[%/\x00]")
_UNESCAPE = re.compile(r"%([0-9A-F]{2})")


@dataclass(frozen=True, slots=True)
class Blob:
    """File content: ``size`` bytes of ``file`` at ``offset``, or ``data`` held in memory."""

    size: int
    file: str | None = None
    offset: int = 0
    data: bytes | None = None


@dataclass(slots=True)
class FileNode:
    inode: int
    content: Blob
    mtime_ns: int
    xattrs: dict[str, bytes] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.content.size


@dataclass(slots=True)
class DirNode:
    inode: int
    mtime_ns: int
    children: dict[str, FileNode | DirNode] = field(default_factory=dict)


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
    parts = _SPLIT.split(name) if layout == "nested" else [name]
    return [escape_component(part) for part in parts]


def join_path(components: Iterable[str]) -> str:
    """The tensor name a nested path stands for (inverse of ``split_name``)."""
    return ".".join(unescape_component(c) for c in components)


class TreeError(Exception):
    """Two things of a multi-model mount want one path."""


class Tree:
    """An immutable tree of folders and files with O(1) path lookup."""

    def __init__(self, mtime_ns: int) -> None:
        self._next_inode = 1
        self.root = DirNode(inode=self._take_inode(), mtime_ns=mtime_ns)
        self._paths: dict[str, Node] = {"/": self.root}
        self.data_size = 0
        self.file_count = 0

    def _take_inode(self) -> int:
        inode = self._next_inode
        self._next_inode += 1
        return inode

    def lookup(self, path: str) -> Node | None:
        """The node at absolute ``path`` ("/a/b"), or ``None``."""
        return self._paths.get(path)

    def listdir(self, path: str) -> list[str] | None:
        """Names in folder ``path``, or ``None`` if it is not a folder."""
        node = self._paths.get(path)
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
                child = DirNode(inode=self._take_inode(), mtime_ns=mtime_ns)
                node.children[component] = child
                self._paths[path] = child
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
        self._paths["/" + "/".join(components)] = node
        self.file_count += 1

    def new_file(self, content: Blob, mtime_ns: int, xattrs: dict[str, bytes] | None = None) -> FileNode:
        return FileNode(inode=self._take_inode(), content=content, mtime_ns=mtime_ns, xattrs=xattrs or {})

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Every (path, node), folders before their contents."""
        yield from self._paths.items()


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
        header_blob = _memory_blob(merged_header(model))
    else:
        header = model.shards[0].header
        header_blob = Blob(size=header.json_length, file=header.path, offset=8)
    tree.add_file([*base, "header.json"], tree.new_file(header_blob, model_mtime))
    _add_metadata(tree, [*base, "metadata"], model.metadata, model_mtime)
    tree.folder([*base, "tensors"], model_mtime)
    _add_tensors(tree, [*base, "tensors"], model.tensors, layout, model)
    if model.index_path is not None:
        with open(model.index_path, "rb") as stream:
            tree.add_file([*base, "index.json"], tree.new_file(_memory_blob(stream.read()), model_mtime))
        tree.folder([*base, "shards"], model_mtime)
        for shard in model.shards:
            header = shard.header
            folder = [*base, "shards", escape_component(shard.name)]
            tree.folder(folder, header.mtime_ns)
            shard_header = Blob(size=header.json_length, file=header.path, offset=8)
            tree.add_file([*folder, "header.json"], tree.new_file(shard_header, header.mtime_ns))
            _add_metadata(tree, [*folder, "metadata"], header.metadata, header.mtime_ns)


def _memory_blob(data: bytes) -> Blob:
    return Blob(size=len(data), data=data)


def _add_metadata(tree: Tree, folder: list[str], metadata: dict[str, str] | object, mtime_ns: int) -> None:
    tree.folder(folder, mtime_ns)
    assert isinstance(metadata, dict)
    for key, value in metadata.items():
        blob = _memory_blob((value + "\n").encode("utf-8", "surrogatepass"))
        tree.add_file([*folder, escape_component(key)], tree.new_file(blob, mtime_ns))


def _add_tensors(tree: Tree, folder: list[str], tensors: tuple[Tensor, ...], layout: str, model: Model) -> None:
    mtimes = {shard.header.path: shard.header.mtime_ns for shard in model.shards}
    paths = [split_name(tensor.name, layout) for tensor in tensors]
    # A name that is also a folder (a.b next to a.b.c) moves into that folder as "%".
    folders = {tuple(components[:i]) for components in paths for i in range(1, len(components))}
    for tensor, components in zip(tensors, paths, strict=True):
        if tuple(components) in folders:
            components = [*components, SELF_NAME]
        node = tree.new_file(
            Blob(size=tensor.size, file=tensor.file, offset=tensor.offset),
            mtimes[tensor.file],
            tensor_xattrs(tensor),
        )
        tree.add_file([*folder, *components], node)


def tensor_xattrs(tensor: Tensor) -> dict[str, bytes]:
    """The ``user.safetensors.*`` extended attributes of a tensor file (SPEC §2)."""
    return {
        "user.safetensors.name": tensor.name.encode("utf-8", "surrogatepass"),
        "user.safetensors.dtype": tensor.dtype.encode(),
        "user.safetensors.shape": json.dumps(list(tensor.shape), separators=(",", ":")).encode(),
        "user.safetensors.file": tensor.file.encode("utf-8", "surrogateescape"),
        "user.safetensors.offset": str(tensor.offset).encode(),
    }


def file_mode(node: Node) -> int:
    return (stat.S_IFDIR | 0o555) if isinstance(node, DirNode) else (stat.S_IFREG | 0o444)
