"""The plain values a pickle becomes: a name, an opaque call, a storage, a tensor; nothing of them is ever run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Global:
    """A name the pickle pushes (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``EXT*``): a name only."""

    module: str
    name: str

    @property
    def full(self) -> str:
        return f"{self.module}.{self.name}"


class Object:
    """An opaque value: a call of a name stfs does not interpret, and what BUILD, SETITEMS, APPENDS gave it."""

    __slots__ = ("callee", "args", "state", "items", "elements")

    def __init__(self, callee: Any, args: Any) -> None:
        self.callee = callee
        self.args = args
        self.state: Any = None
        self.items: dict[Any, Any] | None = None
        self.elements: list[Any] | None = None


class Set(list[Any]):
    """A set or frozenset, kept as a list: its items are never hashed (a hostile item could nest deep)."""

    __slots__ = ()


class Key:
    """A dict key that is not a plain scalar, wrapped so that it hashes by identity, never by its contents."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass(frozen=True, slots=True)
class Large:
    """A string or bytes longer than ``MAX_INLINE``: skipped, never read."""

    kind: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A persistent id ``('storage', type, key, location, numel[, view])``."""

    key: str
    dtype: str | None  # torch's name; None for a storage class stfs does not know
    numel: int  # elements of ``dtype`` (bytes for UntypedStorage)
    view: tuple[int, int] | None  # legacy storage views: (offset, size) in elements of the root storage


@dataclass(frozen=True, slots=True)
class TensorRef:
    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # torch's name


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A tensor stfs does not serve (quantized, sparse, no storage, a conjugate view, ...): why."""

    reason: str


SCALARS = (str, int, float, bool, type(None), bytes, complex, Global, Large)
LEAVES = (TensorRef, Unsupported, StorageRef)


def dict_key(key: Any) -> Any:
    """``key`` as a key of a dict the pickle builds: a scalar as it is, anything else wrapped in a ``Key``."""
    return key if type(key) in SCALARS else Key(key)


def describe(value: Any) -> str:
    """A short description of a pickled value for a message: never its whole contents."""
    if isinstance(value, Global):
        return value.full
    if isinstance(value, (str, bytes)):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, (int, float, bool, type(None))):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "a huge integer"
        return text
    if isinstance(value, Object):
        return f"an object of {describe(value.callee)}"
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__.lstrip('_')}"
