"""Errors of stfs.

One ``FormatError`` subclass per validation rule of SPEC §4, named like the
safetensors reference (``tensor.rs``) names its errors, so a message says
which file, which tensor and which rule.
"""

from __future__ import annotations


class StfsError(Exception):
    """An error the command line reports as one line and exit code 1."""

    @property
    def message(self) -> str:
        return str(self)


class FormatError(StfsError):
    """A safetensors file breaks a rule of SPEC §4."""

    rule = 0
    title = "invalid safetensors file"

    def __init__(self, path: str, detail: str, tensor: str | None = None) -> None:
        self.path = path
        self.detail = detail
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        super().__init__(f"{where}rule {self.rule} ({type(self).__name__}): {detail}")


class HeaderTooSmall(FormatError):
    rule = 1


class HeaderTooLarge(FormatError):
    rule = 2


class InvalidHeaderLength(FormatError):
    rule = 3


class InvalidHeaderStart(FormatError):
    rule = 4


class InvalidHeaderUtf8(FormatError):
    rule = 4


class InvalidHeaderDeserialization(FormatError):
    rule = 5


class InvalidMetadata(FormatError):
    rule = 6


class InvalidTensorInfo(FormatError):
    rule = 7


class MisalignedSlice(FormatError):
    rule = 8


class TensorInvalidInfo(FormatError):
    rule = 9


class ValidationOverflow(FormatError):
    """An element count, bit count or offset does not fit in 64 bits; reported under the rule it broke."""

    def __init__(self, path: str, detail: str, tensor: str | None = None, rule: int = 8) -> None:
        self.rule = rule
        super().__init__(path, detail, tensor)


class InvalidOffset(FormatError):
    rule = 10


class MetadataIncompleteBuffer(FormatError):
    rule = 11


class UnreadableFile(StfsError):
    """A source file cannot be opened or read at all."""


class SourceError(StfsError):
    """A SOURCE argument is not a model, an index or a directory of models."""


class ShardError(StfsError):
    """A sharded set breaks a rule of SPEC §4 (index, missing shard, misplaced tensor)."""


class InvalidIndex(ShardError):
    pass


class MissingShard(ShardError):
    pass


class TensorNotInShard(ShardError):
    pass


class DuplicateTensor(ShardError):
    pass


class MountError(StfsError):
    """Mounting or unmounting failed."""
