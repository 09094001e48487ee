"""What the reader returns (``Checkpoint``, its ``Tensor`` records), made from the named leaves and where the
storages lie: every check on a tensor's place in its storage."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .allowed import TORCH_DTYPES, WEIGHTS_ONLY_GLOBALS
from .rules import TensorOutOfStorage
from .unpickler import Interpreter
from .values import StorageRef, TensorRef, Unsupported


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a checkpoint: where its storage lies in the file, and how its elements lie in the storage.

    ``strides`` and ``storage_offset`` count elements, as torch does. A ``contiguous`` tensor is the one byte
    range ``(offset, nbytes)`` of the file; any other is gathered in C order from ``span`` (see ``gather_into``).
    """

    name: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    storage: str  # the storage's key: "0" (zip), the saving process's id (legacy)
    storage_offset: int
    storage_start: int  # absolute offset of the storage's first byte in the file
    storage_size: int  # bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def offset(self) -> int:
        """Absolute offset of the tensor's first element in its file (``user.pytorch.offset``)."""
        return self.storage_start + self.storage_offset * self.itemsize

    @property
    def contiguous(self) -> bool:
        """Whether the elements lie in C order one after another (torch's ``is_contiguous``)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size == 0:
                return True
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def byte_range(self) -> tuple[int, int] | None:
        """``(absolute offset, size)`` of a contiguous tensor's bytes; None for a strided one."""
        return (self.offset, self.nbytes) if self.contiguous else None

    @property
    def span(self) -> tuple[int, int]:
        """``(absolute offset, size)`` of the bytes of the storage that hold the tensor's elements."""
        if self.numel == 0:
            return (self.offset, 0)
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.strides, strict=True))
        return (self.offset, (last + 1) * self.itemsize)


@dataclass(frozen=True, slots=True)
class LeftOut:
    """A tensor the checkpoint holds that is not served, and why (a warning names it)."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a checkpoint holds, validated: its tensors in the order it first names them, and its globals."""

    path: str
    layout: str  # "zip" or "legacy"
    file_size: int
    tensors: tuple[Tensor, ...]
    left_out: tuple[LeftOut, ...]
    globals: tuple[str, ...]  # every global the pickle names, in the order first named
    unsafe_globals: tuple[str, ...]  # those torch.load(weights_only=True) refuses: loading without it calls them
    model_key: str | None  # "state_dict" when that member of the top dict is the model
    protocol: int  # the pickle's protocol (PROTO), 0 when it has none
    pickle_range: tuple[int, int]  # (absolute offset, size) of the pickle of the object
    archive_name: str | None  # the zip's top folder
    # the pickle's object as plain values (``values``), for a format that reads more than tensors from it (DeepSpeed)
    top_object: Any = field(default=None, compare=False, repr=False)

    @property
    def warnings(self) -> tuple[str, ...]:
        """One line per tensor left out, for a mount's stderr."""
        return tuple(f"{self.path}: tensor {item.name!r} left out: {item.reason}" for item in self.left_out)


@dataclass(frozen=True, slots=True)
class StorageBytes:
    start: int  # absolute
    size: int


def checkpoint_tensors(
    leaves: list[tuple[str, Any]], storages: Mapping[str, StorageBytes], path: str
) -> tuple[list[Tensor], list[LeftOut]]:
    tensors: list[Tensor] = []
    left_out: list[LeftOut] = []
    names: set[str] = set()
    for name, leaf in leaves:
        if name in names:
            left_out.append(LeftOut(name, "an earlier tensor has the same name"))
            continue
        names.add(name)
        if isinstance(leaf, Unsupported):
            left_out.append(LeftOut(name, leaf.reason))
            continue
        if isinstance(leaf, StorageRef):
            left_out.append(LeftOut(name, "a storage, not a tensor"))
            continue
        dtype, itemsize = TORCH_DTYPES[leaf.dtype]
        if dtype is None:
            left_out.append(LeftOut(name, f"dtype torch.{leaf.dtype}, which safetensors does not have"))
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            left_out.append(LeftOut(name, "its name is not valid UTF-8"))
            continue
        if name == "__metadata__":
            left_out.append(LeftOut(name, "safetensors keeps that name for its metadata"))
            continue
        where = storages[leaf.storage.key]
        start, size = where.start, where.size
        if leaf.storage.view is not None:  # a legacy storage view: a slice of its root storage
            view_offset, view_size = (n * itemsize for n in leaf.storage.view)
            if view_offset + view_size > size:
                raise TensorOutOfStorage(
                    path, f"its storage is a view of bytes {view_offset}+{view_size} of a {size}-byte storage", name
                )
            start, size = start + view_offset, view_size
        tensor = Tensor(
            name=name,
            dtype=dtype,
            shape=leaf.shape,
            strides=leaf.strides,
            itemsize=itemsize,
            storage=leaf.storage.key,
            storage_offset=leaf.storage_offset,
            storage_start=start,
            storage_size=size,
        )
        span_start, span_size = tensor.span
        if span_size and span_start + span_size > start + size:
            raise TensorOutOfStorage(
                path,
                f"shape {list(tensor.shape)}, strides {list(tensor.strides)} and storage offset "
                f"{tensor.storage_offset} reach byte {span_start + span_size - start} of a {size}-byte storage",
                name,
            )
        tensors.append(tensor)
    return tensors, left_out


def make_checkpoint(
    *,
    path: str,
    layout: str,
    size: int,
    interpreter: Interpreter,
    leaves: list[tuple[str, Any]],
    model_key: str | None,
    storages: Mapping[str, StorageBytes],
    pickle_range: tuple[int, int],
    archive_name: str | None,
    top_object: Any = None,
) -> Checkpoint:
    tensors, left_out = checkpoint_tensors(leaves, storages, path)
    names = tuple(interpreter.globals)
    return Checkpoint(
        path=path,
        layout=layout,
        file_size=size,
        tensors=tuple(tensors),
        left_out=tuple(left_out),
        globals=names,
        unsafe_globals=tuple(name for name in names if name not in WEIGHTS_ONLY_GLOBALS),
        model_key=model_key,
        protocol=interpreter.protocol,
        pickle_range=pickle_range,
        archive_name=archive_name,
        top_object=top_object,
    )


def used_storages(leaves: Iterable[tuple[str, Any]]) -> dict[str, StorageRef]:
    used: dict[str, StorageRef] = {}
    for _, leaf in leaves:
        if isinstance(leaf, TensorRef) and TORCH_DTYPES[leaf.dtype][0] is not None:
            used.setdefault(leaf.storage.key, leaf.storage)
    return used
