"""What a mount shows of each model: functions from a validated ``Model`` to nodes of the ``Tree``.

Each view adds the files of one model below the model's folder ``base``:

* ``header_files``: ``header.json`` and ``metadata/``;
* ``tensor_files``: ``tensors/``, one file per tensor, a ``Range`` of its source;
* ``shard_files``: a sharded set's ``index.json`` and ``shards/NAME/``;
* chosen with ``--view``: ``npy_files`` (``npy/``), ``f32_files`` (``f32/``), ``stats_files`` (``stats/``) and
  ``png_files`` (``png/``), listed in ``CHOSEN``.

and once per mount ``source_files``: ``files/``, the source's own files byte for byte.

A view is a ``View``: ``(tree, model, base, layout) -> None``. Adding one means writing such a
function and listing it in ``VIEWS`` (always there) or ``CHOSEN`` (by name). No I/O happens here: every
byte a node holds in memory was read while the model was validated.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from . import formats
from .errors import TreeError
from .formats import Header, TensorEntry
from .model import Model, SourceFile, place
from .nodes import Decoded, FileNode, Gathered, Range, Segment, ShardData, Summary
from .readahead import jump_window_kb
from .tree import Tree, escape_component

if TYPE_CHECKING:
    from .decode import Codec

View = Callable[[Tree, Model, list[str], str], None]


def build_tree(
    models: list[Model],
    layout: str = "nested",
    views: tuple[View, ...] | None = None,
    files: list[SourceFile] | None = None,
    jump_windows: bool = False,
) -> Tree:
    """The whole mount: one model at the root, or one folder per model at its name; ``files/`` at the root
    holds ``files``, the source's own files (``model.source_files``), with ``jump_windows`` (a remote source) a
    readahead of their own for its models' files."""
    mtime = max((shard.header.mtime_ns for model in models for shard in model.shards), default=0)
    tree = Tree(mtime_ns=mtime)
    if files is not None:
        source_files(tree, files, mtime, models if jump_windows else ())
        if views is not None and safetensors_view in views:
            safetensors_files(tree, files, mtime, models)
    for model in models:
        base = model.name.split("/") if model.name else []
        tree.folder(base, model.mtime_ns)
        try:
            for view in VIEWS if views is None else views:
                view(tree, model, base, layout)
        except TreeError as exc:
            raise TreeError(f"{model.path}: {exc}") from None
        tree.data_size += model.data_size
    return tree


def header_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``header.json`` (a sharded set's merged) and ``metadata/``."""
    mtime = model.mtime_ns
    if model.is_sharded:
        tree.add_file([*base, "header.json"], mtime, (model.json_made or merged_header(model),))
    else:
        header = model.shards[0].header
        tree.add_file([*base, "header.json"], mtime, (_header_json(header),))
    _add_metadata(tree, [*base, "metadata"], model.shown_metadata, mtime)


def shard_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """A sharded set's ``index.json`` (byte for byte) and ``shards/NAME/`` (each shard's header and metadata)."""
    mtime = model.mtime_ns
    if model.index_bytes is not None:
        tree.add_file([*base, "index.json"], mtime, (model.index_bytes,))
    if model.is_sharded:
        tree.folder([*base, "shards"], mtime)
        for shard in model.shards:
            header = shard.header
            folder = [*base, "shards", escape_component(shard.name)]
            tree.folder(folder, header.mtime_ns)
            tree.add_file([*folder, "header.json"], header.mtime_ns, (_header_json(header),))
            _add_metadata(tree, [*folder, "metadata"], header.metadata, header.mtime_ns)


def tensor_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``tensors/``: each tensor's bytes, a ``Range`` of its shard (made from the shard's ``ShardData``), at the
    path of its name."""

    files: list[FileNode] = []
    for shard in model.shards:
        header = shard.header
        data, mtime = ShardData(header.path, header.data_start), header.mtime_ns
        inodes = tree.take_inodes(len(header.tensors))
        if header.scattered or header.other_files:  # some tensor's bytes are gathered, or in another file
            for inode, entry in zip(inodes, header.tensors, strict=True):
                source = _source(*place(header, entry), entry)
                stored = data if type(source) is Range and entry.file is None else (source,)
                files.append(FileNode(inode, mtime, stored, entry, None, entry.end - entry.begin))
            continue
        # the hot loop of a mount (one node per tensor): no calls it can avoid
        files += [
            FileNode(inode, mtime, data, entry, None, entry.end - entry.begin)
            for inode, entry in zip(inodes, header.tensors, strict=True)
        ]
    tree.add_named_files(tree.folder([*base, "tensors"], model.mtime_ns), layout, files)


def npy_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``npy/``: each tensor as ``PATH.npy``; NumPy's own dtypes keep their bytes, the others become float32."""
    from .decode import F32, NATIVE, codec, npy_header  # numpy and ml_dtypes: only for mounts that ask

    def files() -> Iterator[FileNode]:
        for key, start, mtime, entry in _tensors(model):
            source = _source(key, start, entry)
            decoding = codec(entry.dtype)
            if entry.dtype in NATIVE:
                data: Segment = source
                header = npy_header(NATIVE[entry.dtype], entry.shape)
            elif decoding is not None:
                data = _decoded(source, decoding, entry)
                header = npy_header(F32, entry.shape)
            else:  # a GGML type the gguf package cannot decode: its tensors/ file only
                continue
            yield tree.new_file(mtime, (header, data), entry, "npy")

    tree.add_named_files(tree.folder([*base, "npy"], model.mtime_ns), layout, files(), suffix=".npy")


def f32_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``f32/``: the values of each float tensor as little-endian float32; F32 tensors are their own bytes."""
    from .decode import codec

    def files() -> Iterator[FileNode]:
        for key, start, mtime, entry in _tensors(model):
            source = _source(key, start, entry)
            if entry.dtype == "F32":
                yield tree.new_file(mtime, (source,), entry, "f32")
            elif (decoding := codec(entry.dtype)) is not None:
                yield tree.new_file(mtime, (_decoded(source, decoding, entry),), entry, "f32")

    tree.add_named_files(tree.folder([*base, "f32"], model.mtime_ns), layout, files())


def stats_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``stats/``: each tensor's counts, extremes, moments and histogram as ``PATH.json`` (not C64's), made on the
    first read; the size is known from the header."""
    from .decode import has_values
    from .summary import FINISHED
    from .tensor_stats import stats_file, stats_size

    def files() -> Iterator[FileNode]:
        for key, start, mtime, entry in _tensors(model):
            if has_values(entry.dtype):
                source = _source(key, start, entry)
                gathered = source if type(source) is Gathered else None
                summary = Summary(key, source.offset, stats_size(entry), entry, stats_file, FINISHED, gathered)
                yield tree.new_file(mtime, (summary,), entry, "stats")

    tree.add_named_files(tree.folder([*base, "stats"], model.mtime_ns), layout, files(), suffix=".json")


def png_files(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``png/``: each float or integer tensor with an element as a heatmap ``PATH.png``, made on the first read;
    the size follows from the shape."""
    from .heatmap import has_heatmap, heatmap_file, png_size
    from .summary import FINISHED

    def files() -> Iterator[FileNode]:
        for key, start, mtime, entry in _tensors(model):
            if has_heatmap(entry):
                source = _source(key, start, entry)
                gathered = source if type(source) is Gathered else None
                summary = Summary(key, source.offset, png_size(entry.shape), entry, heatmap_file, FINISHED, gathered)
                yield tree.new_file(mtime, (summary,), entry, "png")

    tree.add_named_files(tree.folder([*base, "png"], model.mtime_ns), layout, files(), suffix=".png")


def _tensors(model: Model) -> Iterator[tuple[str, int, int, TensorEntry]]:
    """Every tensor of ``model``: (source key, its data start, its mtime, the entry)."""
    for shard in model.shards:
        header = shard.header
        for entry in header.tensors:
            key, start = place(header, entry) if header.other_files else (header.path, header.data_start)
            yield key, start, header.mtime_ns, entry


def _source(key: str, start: int, entry: TensorEntry) -> Range | Gathered:
    """A tensor's bytes: a ``Range`` of its file, or gathered in C order (a strided tensor of a checkpoint)."""
    scattered = entry.scattered
    if scattered is not None:
        return Gathered(key, scattered.offset, entry.size, scattered)
    return Range(key, start + entry.begin, entry.size)


def _decoded(source: Range | Gathered, codec: Codec, entry: TensorEntry) -> Decoded:
    gathered = source if type(source) is Gathered else None
    return Decoded(source.key, source.offset, 4 * entry.parameters, codec, gathered)


def _header_json(header: Header) -> Segment:
    """A file's ``header.json``: its JSON as stored, or the one made from its header."""
    if header.json_at is not None:
        return Range(header.path, *header.json_at)
    assert header.json_made is not None
    return header.json_made


def safetensors_view(tree: Tree, model: Model, base: list[str], layout: str) -> None:
    """``--view safetensors`` adds nothing below a model: ``safetensors/`` is at the mount's root
    (``safetensors_files``)."""


VIEWS: tuple[View, ...] = (header_files, tensor_files, shard_files)
CHOSEN: dict[str, View] = {  # --view
    "npy": npy_files,
    "f32": f32_files,
    "stats": stats_files,
    "png": png_files,
    "safetensors": safetensors_view,
}


def safetensors_files(tree: Tree, files: list[SourceFile], mtime_ns: int, models: Iterable[Model]) -> None:
    """``safetensors/``: ``files/`` with each file of a format that converts (a PyTorch checkpoint) a safetensors
    file of its tensors (its ``header.json`` made, then each tensor's bytes: ranges of the file, or gathered), and
    an index of such files naming the converted ones; a name that ``files/`` already holds keeps that file (and the
    file that would have had it is left out: ``safetensors/`` holds nothing it could have converted)."""
    headers = {shard.header.path: shard.header for model in models for shard in model.shards}
    indexes = {model.index_path: model for model in models if model.index_path is not None}
    held = {file.path for file in files}
    converted: set[str] = set()
    tree.folder(["safetensors"], mtime_ns)
    for file in files:
        header = headers.get(file.key)
        model = indexes.get(file.key)
        if model is not None:
            name = _converted_name(model.shards[0].header, file.path)
            if not all(_converted_name(shard.header, shard.header.path) for shard in model.shards):
                name = None
        else:
            name = _converted_name(header, file.path) if header is not None else None
        if name is not None and (name in held or name in converted):
            # the repository has it as safetensors already: that file, no other, unless the format has a second name
            other = formats.named(header.format).safetensors_other_name(file.path) if header is not None else None
            if other is None or other in held or other in converted:
                continue
            name = other
        if name is not None:
            converted.add(name)
        segments: tuple[Segment, ...]
        if name is not None and header is not None:
            parts: list[Segment] = [_safetensors_header(header)]
            parts += [_source(*place(header, entry), entry) for entry in header.tensors if entry.size]
            segments = tuple(parts)
        elif name is not None and model is not None:
            segments = (_safetensors_index(model),)
        else:
            segments = (Range(file.key, 0, file.size),)
        components = ["safetensors", *(escape_component(part) for part in (name or file.path).split("/"))]
        tree.add_file(components, file.mtime_ns, segments)


def _converted_name(header: Header, path: str) -> str | None:
    """The name of the file at ``path`` in ``safetensors/`` where its format shows it converted, else ``None``."""
    return formats.named(header.format).safetensors_name(path)


def _safetensors_header(header: Header) -> bytes:
    """The safetensors header (length, JSON, spaces to a multiple of 8, as the safetensors writer pads it) of a
    header made in the safetensors schema whose tensors' offsets follow one another in their order."""
    assert header.json_made is not None
    text = header.json_made + b" " * (-len(header.json_made) % 8)
    return struct.pack("<Q", len(text)) + text


def _safetensors_index(model: Model) -> bytes:
    """The index of a set of converted files (``model.safetensors.index.json``): its weight_map naming them."""
    assert model.index_bytes is not None
    document = json.loads(model.index_bytes)
    convert = formats.named(model.shards[0].header.format).safetensors_name
    document["weight_map"] = {name: convert(shard) or shard for name, shard in document["weight_map"].items()}
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def with_chosen(names: Iterable[str]) -> tuple[View, ...]:
    """``VIEWS`` and the views named (``--view``), each once, in the order first named."""
    return (*VIEWS, *(CHOSEN[name] for name in dict.fromkeys(names)))


def source_files(tree: Tree, files: list[SourceFile], mtime_ns: int, models: Iterable[Model] = ()) -> None:
    """``files/``: the source's files byte for byte at their paths below SOURCE (each a ``Range`` of itself),
    so any loader can open ``MNT/files/model.safetensors`` and read only what it touches. Those that are shards
    of ``models`` get the kernel readahead of a file a loader jumps into (``readahead.jump_window_kb``)."""
    tree.folder(["files"], mtime_ns)
    shards = {shard.header.path: shard.header for model in models for shard in model.shards}
    for file in files:
        components = ["files", *(escape_component(part) for part in file.path.split("/"))]
        node = tree.add_file(components, file.mtime_ns, (Range(file.key, 0, file.size),))
        header = shards.get(file.key)
        if header is not None:
            tree.readahead_kb[node.inode] = jump_window_kb(entry.size for entry in header.tensors)


def _add_metadata(tree: Tree, folder: list[str], metadata: Mapping[str, str], mtime_ns: int) -> None:
    tree.folder(folder, mtime_ns)
    for key, value in metadata.items():
        # surrogate escapes stand for bytes that were not UTF-8 (a GGUF string): written back as those bytes
        content = (value + "\n").encode("utf-8", "surrogateescape")
        tree.add_file([*folder, escape_component(key)], mtime_ns, (content,))


def merged_header(model: Model) -> bytes:
    """A sharded set's header.json: one object in the safetensors schema plus a ``file`` per tensor."""
    document: dict[str, object] = {}
    if model.metadata:
        document["__metadata__"] = dict(model.metadata)
    for shard in model.shards:
        # a header made from another format (a checkpoint): the offsets of its equivalent safetensors file
        made = json.loads(shard.header.json_made) if shard.header.json_made is not None else {}
        for entry in shard.header.tensors:
            if entry.name in document:
                continue
            offsets = made[entry.name]["data_offsets"] if entry.name in made else [entry.begin, entry.end]
            document[entry.name] = {
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "data_offsets": offsets,
                "file": shard.name,
            }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
