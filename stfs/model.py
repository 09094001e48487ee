"""Models: a SOURCE (file, index, folder) resolved into tensors with their source bytes.

Data flows from a ``ByteSource`` (listing, reading) through ``formats`` (one file's header) to here
(a model made of one or many files); nothing here knows about paths in the mounted tree.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import TypeVar

from . import errors, formats
from .formats import INDEX_SUFFIXES, MODEL_SUFFIXES, Format, Header, Scattered, TensorEntry, encodable
from .progress import Progress
from .sources import ByteSource, Kind, LocalFiles, base_name, join_key, parent_key, relative_key

T = TypeVar("T")
R = TypeVar("R")

MAX_INDEX_LENGTH = 100_000_000


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor of a model: its bytes are ``size`` bytes of ``file`` at absolute ``offset``; or, where they are
    not one range (a strided tensor of a checkpoint), gathered in C order by ``scattered``; ``offset`` its first."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    size: int
    shard: str | None = None
    scattered: Scattered | None = field(default=None, compare=False)

    @property
    def parameters(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Shard:
    """One file of a sharded set, ``name`` spelled as the index's ``weight_map`` spells it."""

    name: str
    header: Header


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model lives, before its headers are read: ``name`` is its folder in a multi-model mount."""

    name: str
    path: str
    header: Header | None = field(default=None, compare=False)  # read already, where discovery had to

    @property
    def is_index(self) -> bool:
        return self.path.endswith(".index.json")

    @property
    def is_split(self) -> bool:
        """A file of a split set (``x-00001-of-00003.gguf``): the whole set is the model."""
        return split_names(base_name(self.path)) is not None


@dataclass(frozen=True, slots=True)
class Model:
    """A validated model: a single file (one shard, no index) or a sharded set."""

    name: str
    path: str
    metadata: Mapping[str, str]
    shards: tuple[Shard, ...]
    index_path: str | None = None
    index_bytes: bytes | None = None  # the index file as read when validated
    warnings: tuple[str, ...] = field(default=())
    split: bool = False  # a split set: sharded without an index
    json_made: bytes | None = None  # a sharded set's header.json, where its format makes it (a split set)
    store_metadata: Mapping[str, str] = field(default_factory=dict)  # what its store says (an OCI manifest's digest)

    @property
    def shown_metadata(self) -> Mapping[str, str]:
        """What ``metadata/`` shows: the headers' metadata, then its store's keys that they lack."""
        if not self.store_metadata:
            return self.metadata
        return {**self.metadata, **{key: v for key, v in self.store_metadata.items() if key not in self.metadata}}

    @property
    def is_sharded(self) -> bool:
        return self.index_path is not None or self.split

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor, shard by shard in header order; made on each call (mounting reads the headers instead)."""
        return tuple(tensor for shard in self.shards for tensor in _tensors_of(shard, self.is_sharded))

    @property
    def data_size(self) -> int:
        return sum(entry.size for shard in self.shards for entry in shard.header.tensors)

    @property
    def mtime_ns(self) -> int:
        """The newest of its shards' modification times."""
        return max(shard.header.mtime_ns for shard in self.shards)


@dataclass(frozen=True, slots=True)
class SourceFile:
    """A file of SOURCE as ``files/`` shows it: ``path`` below SOURCE's folder, its key, size and age."""

    path: str
    key: str
    size: int
    mtime_ns: int


def source_files(key: str, source: ByteSource, models: list[Model]) -> list[SourceFile]:
    """SOURCE's own files: for a file, that file; for an index, it and its shards; for a folder (or a
    repository, a bucket prefix), every regular file below it."""
    try:
        if source.kind(key) is Kind.FOLDER:
            root, keys = key, source.walk(key)
        else:
            root = parent_key(key)
            keys = [key] + [shard.header.path for model in models if model.is_sharded for shard in model.shards]
            keys += [file for model in models for file in _other_files(model)]
        files = []
        for file in dict.fromkeys(keys):
            if source.kind(file) is not Kind.FILE:
                continue
            info = source.stat(file)
            files.append(SourceFile(relative_key(root, file), file, info.size, info.mtime_ns))
    except OSError as exc:
        raise errors.SourceError(f"{key}: cannot list its files: {exc.strerror or exc}") from None
    return sorted(files, key=lambda file: file.path)


def _other_files(model: Model) -> Iterator[str]:
    """The keys of the files beside its headers' that a model's tensors lie in (an ONNX model's external data)."""
    for shard in model.shards:
        folder = parent_key(shard.header.path)
        yield from (join_key(folder, file) for file in shard.header.other_files)


def read_header(key: str, source: ByteSource | None = None) -> Header:
    """Read and validate the header of the safetensors file ``key`` of ``source`` (default: a local path, whose
    descriptor is closed after it)."""
    if source is None:
        with closing(LocalFiles()) as own:
            return read_header(key, own)
    try:
        info = source.stat(key)
    except OSError as exc:
        raise errors.UnreadableFile(f"{key}: cannot open: {exc.strerror or exc}") from exc

    fetch = _Fetcher(source, key)
    known = formats.identify(key, fetch, info.size)
    header = formats.read_with(
        known, fetch, path=key, file_size=info.size, mtime_ns=info.mtime_ns, first_read=source.first_read
    )
    if header.other_files:
        _check_other_files(header, source)
    return header


def _check_other_files(header: Header, source: ByteSource) -> None:
    """Each other file a tensor's bytes lie in (``TensorEntry.file``) is a file that holds them; stat'ing it pins it
    for the mount, as its header's file is."""
    sizes: dict[str, int | None] = {}
    for entry in header.tensors:
        if entry.file is None or entry.scattered is not None:  # a scattered tensor's format checked what it reads
            continue
        key = place(header, entry)[0]
        if key not in sizes:
            try:
                sizes[key] = source.stat(key).size if source.kind(key) is Kind.FILE else None
            except OSError:
                sizes[key] = None
        size = sizes[key]
        if size is None:
            raise errors.MissingDataFile(header.path, f"its bytes are in {entry.file!r}, which is missing", entry.name)
        if entry.end > size:
            raise errors.DataFileTooShort(
                header.path,
                f"its bytes are [{entry.begin}, {entry.end}) of {entry.file!r}, which is {size} bytes",
                entry.name,
            )


class _Fetcher:
    """``(offset, size) -> bytes`` of the file ``key`` of ``source``, for a format's header reader; ``many`` reads
    ranges that do not depend on each other (a checkpoint's storages' local headers) at once: in parallel from a
    remote source, where each is a request; ``folder``: the other files of its folder (``formats.Folder``)."""

    def __init__(self, source: ByteSource, key: str) -> None:
        self.source = source
        self.key = key

    @property
    def folder(self) -> _Folder:
        return _Folder(self.source, parent_key(self.key))

    def __call__(self, offset: int, size: int) -> bytes:
        try:
            return self.source.read(self.key, offset, size)
        except OSError as exc:
            raise errors.UnreadableFile(f"{self.key}: cannot read: {exc.strerror or exc}") from exc

    def many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return _each(lambda where: self(*where), list(ranges), self.source.concurrency)


class _Folder:
    """The files of the folder ``key`` of ``source`` by name, for a format that reads them with its header's
    (``formats.Folder``)."""

    def __init__(self, source: ByteSource, key: str) -> None:
        self.source = source
        self.key = key

    def size(self, file: str) -> int | None:
        key = join_key(self.key, file)
        try:
            return self.source.stat(key).size if self.source.kind(key) is Kind.FILE else None
        except OSError:
            return None

    def fetcher(self, file: str) -> _Fetcher:
        return _Fetcher(self.source, join_key(self.key, file))


def discover(key: str, source: ByteSource | None = None) -> list[ModelSource]:
    """The models ``key`` names (docs/sources.md), without reading any safetensors header.

    Without ``source``, ``key`` is a local path (the descriptors opened for it closed after).
    """
    if source is None:
        with closing(LocalFiles()) as own:
            return discover(os.path.abspath(key), own)
    try:
        kind = source.kind(key)
        if kind is Kind.FOLDER:
            return _discover_folder(source, key)
    except OSError as exc:
        raise errors.SourceError(f"{key}: {exc.strerror or exc}") from None
    if kind is Kind.FILE:
        return [ModelSource(name="", path=key)]
    if kind is Kind.OTHER:
        raise errors.SourceError(f"{key}: not a file or a directory")
    raise errors.SourceError(f"{key}: no such file or directory")


def _discover_folder(source: ByteSource, root: str) -> list[ModelSource]:
    indexes: list[str] = []
    files: list[str] = []
    may_hold_model = getattr(source, "may_hold_model", None)  # a store's: a container image's model is in /models
    for key in source.walk(root):
        if may_hold_model is not None and not may_hold_model(key):
            continue
        name = base_name(key)
        if name.endswith(INDEX_SUFFIXES):
            indexes.append(key)
        elif name.endswith(MODEL_SUFFIXES) and source.kind(key) is Kind.FILE:
            split = split_names(name)  # a split of a set stands for the set: its first split's key
            files.append(join_key(parent_key(key), split[1][0]) if split else key)
    files = list(dict.fromkeys(files))
    shard_keys: set[str] = set()
    for index in indexes:
        weight_map = _read_weight_map(index, _read_index(source, index)[0])
        shard_keys.update(join_key(parent_key(index), shard) for shard in set(weight_map.values()))
    headers, whole = _folder_models(source, files)
    models = []
    for key in sorted(indexes + files):
        if key in shard_keys or (key not in headers and any(_below(key, folder) for folder in whole)):
            continue
        claimed = formats.claiming(base_name(key))
        if claimed is not None and claimed.folder_model:
            if key not in headers:
                continue
        elif claimed is not None and claimed.confirm_in_folder:
            header = _confirmed_header(source, key, claimed)
            if header is None:
                continue
            headers[key] = header
        models.append(key)
    # a file another model reads (a torch_dist folder's common.pt) is that model's, not one of its own
    owned = {join_key(parent_key(key), file) for key, header in headers.items() for file in header.other_files}
    models = [key for key in models if key not in owned or key in headers and headers[key].other_files]
    if not models:
        files_text, indexes_text = " or ".join(MODEL_SUFFIXES), " or ".join(INDEX_SUFFIXES)
        raise errors.SourceError(f"{root}: no {files_text} file or {indexes_text} found")
    if len(models) == 1 and not getattr(source, "named_models", False):
        return [ModelSource(name="", path=models[0], header=headers.get(models[0]))]
    result = [ModelSource(_name_in(source, root, key, models), key, headers.get(key)) for key in models]
    seen: dict[str, str] = {}
    for model in result:
        if model.name in seen:
            raise errors.SourceError(f"{model.path}: model name {model.name!r} is also taken by {seen[model.name]}")
        seen[model.name] = model.path
    return result


def _folder_models(source: ByteSource, files: list[str]) -> tuple[dict[str, Header], list[str]]:
    """The files that stand for their folder (``Format.folder_model``: a DeepSpeed checkpoint's ``latest`` or model
    state), confirmed, shallowest first: their headers, and the folders whose model files are theirs."""
    headers: dict[str, Header] = {}
    whole: list[str] = []
    claims = [(key, formats.claiming(base_name(key))) for key in files]
    for key, claimed in sorted(claims, key=lambda claim: (claim[0].count("/"), claim[0])):
        if claimed is None or not claimed.folder_model or any(_below(key, folder) for folder in whole):
            continue
        try:  # read by its name (no sniff: a model state cut short is a broken checkpoint, not another file)
            header = read_header(key, source)
        except errors.FormatError as exc:
            if exc.refutes_format:  # a latest that names no tag of it
                continue
            raise
        headers[key] = header
        whole.append(parent_key(key))
    return headers, whole


def _below(key: str, folder: str) -> bool:
    return key.startswith(folder.rstrip("/") + "/")


def _confirmed_header(source: ByteSource, key: str, claimed: Format) -> Header | None:
    """The header of the file ``key`` that a folder holds under a name ``claimed`` claims but may hold other files
    under (any ``.bin``), or ``None`` where it is not a model: its first bytes are not the format's, it is not of
    the format after all (a zip that is not a torch.save archive), or it holds no tensor (``training_args.bin``)."""
    try:
        head = source.read(key, 0, claimed.head_size)
    except OSError as exc:
        raise errors.UnreadableFile(f"{key}: cannot read: {exc.strerror or exc}") from exc
    if not claimed.sniff(head):
        return None
    try:
        header = read_header(key, source)
    except errors.FormatError as exc:
        if exc.refutes_format:
            return None
        raise
    return header if header.tensors else None


def _name_in(source: ByteSource, root: str, key: str, models: list[str]) -> str:
    """The folder of the model ``key`` in a multi-model mount of ``root``: the folder of the artifact holding it
    where a store groups its files so (``MappedFiles.group_of``: ``library/llama3.2:1b``) and it is the artifact's
    one model; else its path less the suffix (``_model_name``)."""
    group_of = getattr(source, "group_of", None)
    if group_of is not None:
        group = group_of(key)
        if group is not None and group.key != root and [group_of(other) for other in models].count(group) == 1:
            return relative_key(root, group.key)
    return _model_name(relative_key(root, key))


def _model_name(relative: str) -> str:
    split = split_names(base_name(relative))
    if split is not None:  # x-00001-of-00003.gguf: the set x
        return relative[: len(relative) - len(base_name(relative))] + split[0]
    claimed = formats.claiming(base_name(relative))
    if claimed is not None and claimed.folder_model:  # it stands for its folder: the model is named so
        return posixpath.dirname(relative) or relative
    for suffix in (*INDEX_SUFFIXES, *MODEL_SUFFIXES):
        if relative.endswith(suffix):  # a file named as its format names one (a DCP's .metadata): its folder
            return relative[: -len(suffix)].rstrip("/") or relative
    return relative


def load(model_source: ModelSource, source: ByteSource | None = None, progress: Progress | None = None) -> Model:
    """Read and check every header of ``model_source``; raise on the first broken rule (all shards are checked).
    Without ``source``, local files (the descriptors opened for them closed after)."""
    if source is None:
        with closing(LocalFiles()) as own:
            return load(model_source, own, progress)
    if model_source.is_index:
        return _with_group(_load_sharded(source, model_source, progress or Progress()), source)
    if model_source.is_split:
        return _with_group(_load_split_set(source, model_source, progress or Progress()), source)
    header = model_source.header or read_header(model_source.path, source)
    shard = Shard(name=base_name(model_source.path), header=header)
    model = Model(
        name=model_source.name,
        path=model_source.path,
        metadata=header.metadata,
        shards=(shard,),
        warnings=header.warnings,
    )
    return _with_group(model, source)


def _with_group(model: Model, source: ByteSource) -> Model:
    """``model`` with what the store says of the artifact holding it (an OCI manifest's digest, reference and
    annotations in its metadata; layers left out in its warnings), where a store groups files so."""
    group_of = getattr(source, "group_of", None)
    group = group_of(model.path) if group_of is not None else None
    if group is None:
        return model
    return replace(model, store_metadata=group.metadata, warnings=(*model.warnings, *group.warnings))


def resolve(key: str, source: ByteSource | None = None, progress: Progress | None = None) -> list[Model]:
    """Every model ``key`` names, validated; without ``source``, ``key`` is a local path (the descriptors opened for it
    closed after)."""
    if source is None:
        with closing(LocalFiles()) as own:
            return resolve(os.path.abspath(key), own, progress)
    progress = progress or Progress()
    try:
        return load_all(discover(key, source), source, progress)
    finally:
        progress.finish()


def load_all(model_sources: list[ModelSource], source: ByteSource, progress: Progress | None = None) -> list[Model]:
    """Every model of ``model_sources`` (``discover``'s), loaded. Of a folder's several, a file its format refuses
    (a ``FormatError``: a compressed ``.npz`` of data beside a model) is left out with a warning, its file still in
    ``files/``; the others mount (one that is left alone at the mount's root). Where every one is refused, the first
    refusal is raised; a sharded or split set's refusal always is."""
    if len(model_sources) == 1:
        return [load(model_sources[0], source, progress)]
    models: list[Model] = []
    refused: list[errors.FormatError] = []
    for model_source in model_sources:
        try:
            models.append(load(model_source, source, progress))
        except errors.FormatError as exc:
            if model_source.is_index or model_source.is_split:
                raise
            refused.append(exc)
    if not models:
        raise refused[0]
    if refused:
        notes = tuple(f"{exc.message}: not mounted (the file is in files/)" for exc in refused)
        first = models[0]
        models[0] = replace(first, name="" if len(models) == 1 else first.name, warnings=(*notes, *first.warnings))
    return models


def place(header: Header, entry: TensorEntry) -> tuple[str, int]:
    """The key of the file a tensor's bytes lie in, and where its ``begin`` counts from there: its header's file
    and data section, or the other file of that folder its format names (``TensorEntry.file``) from its start."""
    if entry.file is None:
        return header.path, header.data_start
    return join_key(parent_key(header.path), entry.file), 0


def _tensors_of(shard: Shard, sharded: bool) -> Iterator[Tensor]:
    header = shard.header
    for entry in header.tensors:
        file, start = place(header, entry) if header.other_files else (header.path, header.data_start)
        yield Tensor(
            name=entry.name,
            dtype=entry.dtype,
            shape=entry.shape,
            file=file,
            offset=start + entry.begin,
            size=entry.size,
            shard=shard.name if sharded else None,
            scattered=entry.scattered,
        )


def _read_index(source: ByteSource, index: str) -> tuple[dict, bytes]:
    """The index's JSON object and its bytes."""
    try:
        raw = source.read(index, 0, MAX_INDEX_LENGTH + 1)
    except OSError as exc:
        raise errors.InvalidIndex(f"{index}: cannot read index: {exc.strerror or exc}") from exc
    if len(raw) > MAX_INDEX_LENGTH:
        raise errors.InvalidIndex(f"{index}: index is larger than {MAX_INDEX_LENGTH} bytes")
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise errors.InvalidIndex(f"{index}: index is not valid JSON: {detail}") from None
    if not isinstance(document, dict):
        raise errors.InvalidIndex(f"{index}: index is not a JSON object")
    return document, raw


def _read_weight_map(index: str, document: dict) -> dict[str, str]:
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise errors.InvalidIndex(f"{index}: index has no weight_map of tensor name -> shard file")
    if not weight_map:
        raise errors.InvalidIndex(f"{index}: weight_map names no tensor")
    for shard in set(weight_map.values()):
        parts = shard.replace("\\", "/").split("/")
        if shard.startswith("/") or ".." in parts or not shard:
            raise errors.InvalidIndex(f"{index}: shard {shard!r} is not a path inside the index's folder")
        if not encodable(shard):
            # A \udcXX escape would otherwise name a non-UTF-8 file, whose name no header.json could then hold.
            raise errors.InvalidIndex(f"{index}: shard {shard!r} holds a lone UTF-16 surrogate")
    return weight_map


def _natural_key(name: str) -> list[tuple[int, int, str]]:
    """Sort ``shard-2`` before ``shard-10`` (digit runs compare by value, without int() of a huge run)."""
    key = []
    for part in re.split(r"([0-9]+)", name):
        digits = part.lstrip("0")
        key.append((0, len(digits), digits) if part.isascii() and part.isdigit() else (1, 0, part))
    key.append((2, 0, name))  # "01" and "1" tie above
    return key


def _shard_path(index: str, shard: str) -> str:
    return join_key(parent_key(index), shard)


def _each(function: Callable[[T], R], items: list[T], concurrency: int) -> list[R]:
    """``function`` over ``items``, in order; ``concurrency`` at a time (a remote source reads headers in parallel)."""
    if concurrency <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor  # remote sources only

    with ThreadPoolExecutor(max_workers=min(concurrency, len(items))) as pool:
        return list(pool.map(function, items))


def _load_sharded(source: ByteSource, model_source: ModelSource, progress: Progress) -> Model:
    index = model_source.path
    document, raw = _read_index(source, index)
    weight_map = _read_weight_map(index, document)
    indexed = formats.indexing(base_name(index))
    if indexed is not None:  # as its shards' headers name their tensors (a Flax index: keys joined by "/")
        weight_map = {indexed.index_name(name): shard for name, shard in weight_map.items()}
    problems: list[errors.StfsError] = []
    shards: list[Shard] = []
    # In shard-name order, not the weight_map's (usually sorted by tensor name): "the first shard" is model-00001.
    loaded: set[str] = set()
    spellings = sorted(set(weight_map.values()), key=lambda n: (_natural_key(posixpath.normpath(n)), len(n), n))
    unique = []
    for shard_name in spellings:
        path = _shard_path(index, shard_name)
        if path not in loaded:  # one file spelled two ways ("a.safetensors", "./a.safetensors"): read it once
            loaded.add(path)
            unique.append((shard_name, path))

    def load_shard(item: tuple[str, str]) -> Shard | errors.StfsError:
        shard_name, path = item
        try:
            if source.kind(path) is not Kind.FILE:
                return errors.MissingShard(f"{index}: shard {shard_name!r} named by weight_map is missing")
            return Shard(name=shard_name, header=read_header(path, source))
        except errors.StfsError as exc:
            return exc
        finally:
            progress.step()

    progress.start(len(unique))
    for result in _each(load_shard, unique, source.concurrency):
        if isinstance(result, Shard):
            shards.append(result)
        else:
            problems.append(result)
    if problems:
        raise errors.InvalidModel(problems)

    warnings: list[str] = [warning for shard in shards for warning in shard.header.warnings]
    owner: dict[str, str] = {}
    total = 0
    for shard in shards:
        for entry in shard.header.tensors:
            if entry.name in owner:
                problems.append(
                    errors.DuplicateTensor(
                        f"{index}: tensor {entry.name!r} is in both {owner[entry.name]!r} and {shard.name!r}"
                    )
                )
                continue
            owner[entry.name] = shard.name
            total += entry.size
            if entry.name not in weight_map:
                warnings.append(f"{shard.header.path}: tensor {entry.name!r} is not named by the index {index}")
    for name, shard_name in weight_map.items():
        if name not in owner or _shard_path(index, owner[name]) != _shard_path(index, shard_name):
            where = f"; it is in {owner[name]!r}" if name in owner else ""
            problems.append(
                errors.TensorNotInShard(
                    f"{index}: tensor {name!r} is mapped to shard {shard_name!r}, which lacks it{where}"
                )
            )
    if problems:
        raise errors.InvalidModel(problems)

    declared = document.get("metadata", {}).get("total_size") if isinstance(document.get("metadata"), dict) else None
    if declared is not None and declared != total:
        warnings.append(f"{index}: metadata.total_size is {declared} but the shards hold {total} bytes of tensors")

    metadata: dict[str, str] = {}
    for shard in shards:
        for key, value in shard.header.metadata.items():
            metadata.setdefault(key, value)
    return Model(
        name=model_source.name,
        path=index,
        metadata=metadata,
        shards=tuple(shards),
        index_path=index,
        index_bytes=raw,
        warnings=tuple(warnings),
    )


def split_names(file_name: str) -> tuple[str, list[str]] | None:
    """For a file of a split set, the set's name and its files' names in order; else ``None``."""
    claimed = formats.claiming(file_name)
    return claimed.split_set(file_name) if claimed is not None else None


def _load_split_set(source: ByteSource, model_source: ModelSource, progress: Progress) -> Model:
    """A split set named by any of its files: every file read and checked, then merged (SPEC §11)."""
    claimed = formats.claiming(base_name(model_source.path))
    found = split_names(base_name(model_source.path))
    assert claimed is not None and found is not None
    prefix, names = found
    keys = [join_key(parent_key(model_source.path), name) for name in names]

    def load_split(key: str) -> Header | None:
        try:
            return read_header(key, source) if source.kind(key) is Kind.FILE else None
        finally:
            progress.step()

    progress.start(len(keys))
    headers = _each(load_split, keys, source.concurrency)
    merged = claimed.merge_split_set(prefix, names, headers)
    shards = tuple(Shard(name, header) for name, header in zip(names, headers, strict=True) if header is not None)
    return Model(
        name=model_source.name,
        path=keys[0],
        metadata=merged.metadata,
        shards=shards,
        split=True,
        json_made=merged.json_made,
    )
