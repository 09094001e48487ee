"""Errors of stfs.

One ``FormatError`` subclass per validation rule (README.md, "Validation"), named like the
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
    """A safetensors file breaks a validation rule; ``rule`` is its number."""

    rule = 0
    title = "invalid safetensors file"

    def __init__(self, path: str, detail: str, tensor: str | None = None) -> None:
        self.path = path
        self.detail = detail
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        super().__init__(f"{where}rule {self.rule} ({type(self).__name__}): {detail}")


class HeaderTooSmall(FormatError):
    """The file is shorter than the 8-byte header length."""

    rule = 1


class HeaderTooLarge(FormatError):
    """The header length exceeds 100,000,000 bytes."""

    rule = 2


class InvalidHeaderLength(FormatError):
    """The header runs past the end of the file."""

    rule = 3


class InvalidHeaderStart(FormatError):
    """The header does not begin with ``{``."""

    rule = 4


class InvalidHeaderUtf8(FormatError):
    """The header is not UTF-8."""

    rule = 4


class InvalidHeaderDeserialization(FormatError):
    """The header is not valid JSON as the reference (serde_json) reads it."""

    rule = 5


class RecursionLimitExceeded(InvalidHeaderDeserialization):
    """Containers nest 128 deep or more: serde_json's ``RecursionLimitExceeded`` (it allows 127)."""


class NumberOutOfRange(InvalidHeaderDeserialization):
    """A number literal is beyond float64 as serde_json computes it: its ``NumberOutOfRange``."""


class DuplicateKey(InvalidHeaderDeserialization):
    """An object repeats a key (serde's ``duplicate field`` where the reference refuses it; stfs refuses every one)."""


class InvalidMetadata(FormatError):
    """``__metadata__`` is not a flat string-to-string map."""

    rule = 6


class MalformedTensorInfo(FormatError):
    """A tensor's info lacks a known ``dtype``, a ``shape`` of integers or two ``data_offsets``."""

    rule = 7


class MisalignedSlice(FormatError):
    """Element count x dtype bits is not a whole number of bytes."""

    rule = 8


class TensorInvalidInfo(FormatError):
    """A tensor's ``data_offsets`` span a different size than its dtype and shape need."""

    rule = 9


class ValidationOverflow(FormatError):
    """An element count, bit count or offset does not fit in 64 bits; reported under the rule it broke."""

    def __init__(self, path: str, detail: str, tensor: str | None = None, rule: int = 8) -> None:
        self.rule = rule
        super().__init__(path, detail, tensor)


class InvalidOffset(FormatError):
    """Sorted by offset, the tensors leave a gap or overlap."""

    rule = 10


class MetadataIncompleteBuffer(FormatError):
    """The tensors do not end where the data section ends."""

    rule = 11


class UnreadableFile(StfsError):
    """A source file cannot be opened or read at all."""


class SourceError(StfsError):
    """A SOURCE argument is not a model, an index or a directory of models."""


class ShardError(StfsError):
    """A sharded set breaks a rule (README.md, "Validation"): index, missing shard, misplaced tensor."""


class InvalidIndex(ShardError):
    """The index is not a JSON object with a ``weight_map`` of tensor name -> shard file inside its folder."""


class MissingShard(ShardError):
    """A shard the ``weight_map`` names does not exist."""


class TensorNotInShard(ShardError):
    """A tensor the ``weight_map`` names is not in the shard it names."""


class DuplicateTensor(ShardError):
    """One tensor name is in two shards."""


class InvalidModel(StfsError):
    """Several problems in one model; ``problems`` holds one error per problem."""

    def __init__(self, problems: list[StfsError]) -> None:
        self.problems = problems
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{problems[0]}{more}")


class TreeError(StfsError):
    """Two things of a multi-model mount want one path."""


class MountError(StfsError):
    """Mounting or unmounting failed."""


class PytorchError(FormatError):
    """A PyTorch checkpoint is refused (SPEC §12): it breaks a rule of its layout, or a bound of the pickle reader.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid PyTorch checkpoint"

    def __init__(self, path: str, detail: str, tensor: str | None = None) -> None:
        self.path = path
        self.detail = detail
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        StfsError.__init__(self, f"{where}PyTorch {self.rule_text} ({type(self).__name__}): {detail}")


class NotACheckpoint(PytorchError):
    """The file is neither a torch.save zip archive nor the format before it."""

    rule_text = "checkpoint format"


class LegacyTarCheckpoint(PytorchError):
    """The tar format of PyTorch 0.x, which current torch cannot load with ``weights_only`` either."""

    rule_text = "checkpoint format"


class TorchScriptArchive(PytorchError):
    """A ``torch.jit.save`` archive (``constants.pkl``, ``code/``): a program, not a checkpoint."""

    rule_text = "not TorchScript"


class BigEndianCheckpoint(PytorchError):
    """A checkpoint whose ``byteorder`` record (or legacy ``sys_info``) says big-endian."""

    rule_text = "little-endian data"


class CheckpointTruncated(PytorchError):
    """The file ends before something its own structure says is there."""

    rule_text = "bytes inside the file"


class InvalidZipArchive(PytorchError):
    """The zip structure is broken: end records, central directory, a local header, a duplicate or missing entry."""

    rule_text = "zip archive"


class EntryOutsideArchive(PytorchError):
    """An entry lies outside the archive's one top folder (or its name climbs out with ``..``)."""

    rule_text = "one top folder"


class CompressedEntry(PytorchError):
    """An entry stfs must read or serve is compressed (or encrypted), not stored."""

    rule_text = "stored entries"


class InvalidPickle(PytorchError):
    """The pickle is malformed: an unknown opcode, a stack or memo that does not hold what an opcode needs."""

    rule_text = "pickle"


class PickleLimitExceeded(PytorchError):
    """A bound of the pickle reader is exceeded: opcodes, memo entries, nesting, a walk of the structure, a name."""

    rule_text = "pickle within bounds"


class PickleTooDeep(PickleLimitExceeded):
    """Marks or containers nest more than 1,000 deep."""


class PickleStringTooLong(PickleLimitExceeded):
    """A string, bytes or line runs past the end of the pickle (so past the end of the file)."""


class InvalidStorage(PytorchError):
    """A storage is missing, or its size disagrees with what the pickle says of it."""

    rule_text = "storages"


class InvalidTensorArgs(PytorchError):
    """A tensor's rebuild arguments are not a storage, an offset, a shape and strides of non-negative integers."""

    rule_text = "tensor description"


class TensorOutOfStorage(PytorchError):
    """A tensor's elements reach bytes outside its storage."""

    rule_text = "tensor inside its storage"
