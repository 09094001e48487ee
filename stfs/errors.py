"""Errors of stfs.

One ``FormatError`` subclass per validation rule (docs/validation.md), named like the
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
    refutes_format = False  # the file is not of the format at all (a zip that is no checkpoint), not a broken one

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


class RuleError(FormatError):
    """A refusal named by its rule in a few words (``rule_text``), not by a safetensors rule number: the message
    names the file, the tensor where there is one, the format (``format_name``), the rule and why."""

    format_name = ""
    rule_text = ""

    def __init__(self, path: str, detail: str, tensor: str | None = None) -> None:
        self.path = path
        self.detail = detail
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        rule = f"{self.format_name} {self.rule_text}" if self.format_name else self.rule_text
        StfsError.__init__(self, f"{where}{rule} ({type(self).__name__}): {detail}")


class TruncatedFile(RuleError):
    """The file ends before something its own structure says is there (``formats.base.read_exact``); a format may
    word it as its own error (a checkpoint's ``CheckpointTruncated``)."""

    rule_text = "bytes inside the file"


class GgufError(RuleError):
    """A GGUF file breaks a rule of llama.cpp's reader (README.md, "GGUF"); ``rule`` names it in a few words."""

    rule_text = "invalid GGUF file"
    format_name = "GGUF"


class GgufTruncated(GgufError):
    """The file ends inside a fixed-size field of the header (llama.cpp: reading past the end fails)."""

    rule_text = "header inside the file"


class InvalidMagic(GgufError):
    """The file does not start with ``GGUF``."""

    rule_text = "magic"


class UnsupportedVersion(GgufError):
    """The version is 0 or above 3."""

    rule_text = "version 2 or 3"


class ObsoleteVersion(UnsupportedVersion):
    """Version 1 (u32 counts and lengths), which llama.cpp no longer reads."""


class BigEndianFile(UnsupportedVersion):
    """The version reads byte-swapped: a big-endian file, which llama.cpp refuses on a little-endian host."""


class InvalidCount(GgufError):
    """A tensor or key/value count is negative as an i64, or more than the bytes left could hold."""

    rule_text = "counts that fit in the file"


class StringTooLong(GgufError):
    """A string is longer than 1 GiB or than the bytes left in the file."""

    rule_text = "string length"


class ArrayTooLong(GgufError):
    """An array has more than 2^30 elements or more than the bytes left could hold."""

    rule_text = "array length"


class EmptyKey(GgufError):
    """A key/value pair has an empty key."""

    rule_text = "non-empty key"


class DuplicateKvKey(GgufError):
    """Two key/value pairs share a key."""

    rule_text = "unique keys"


class InvalidKvType(GgufError):
    """A value type outside 0-12 (or an array whose element type is), or an array of arrays."""

    rule_text = "value type"


class InvalidAlignment(GgufError):
    """``general.alignment`` is not a u32, or is 0 or not a power of two."""

    rule_text = "alignment"


class TensorNameTooLong(GgufError):
    """A tensor name of 64 bytes or more (ggml's GGML_MAX_NAME counts the NUL)."""

    rule_text = "tensor name under 64 bytes"


class DuplicateTensorName(GgufError):
    """Two tensors share a name (as C strings: llama.cpp compares names up to a NUL)."""

    rule_text = "unique tensor names"


class InvalidDimensions(GgufError):
    """More than 4 dimensions, or a negative one."""

    rule_text = "dimensions"


class UnknownGgmlType(GgufError):
    """A tensor type that gguf 0.19 does not know (out of range, or a removed type)."""

    rule_text = "GGML type"


class RowNotBlockMultiple(GgufError):
    """The first dimension is not a multiple of the type's block size."""

    rule_text = "rows of whole blocks"


class GgufOverflow(GgufError):
    """An element count, a byte size or the running data size does not fit (INT64_MAX, SIZE_MAX)."""

    rule_text = "no overflow"


class DataSectionOutOfFile(GgufError):
    """The data section's start, padded to the alignment, lies past the end of the file."""

    rule_text = "data section inside the file"


class TensorOffsetMismatch(GgufError):
    """A tensor's offset is not the sum of the padded sizes of the tensors before it."""

    rule_text = "tensor offsets"


class TensorOutOfFile(GgufError):
    """A tensor's bytes run past the end of the file (llama.cpp's model loader check)."""

    rule_text = "tensor data inside the file"


class UnreadableFile(StfsError):
    """A source file cannot be opened or read at all."""


class SourceError(StfsError):
    """A SOURCE argument is not a model, an index or a directory of models."""


class UnknownFormat(StfsError):
    """A file of no format stfs reads: the message names the formats it reads."""


class ShardError(StfsError):
    """A sharded set breaks a rule (docs/validation.md): index, missing shard, misplaced tensor."""


class InvalidIndex(ShardError):
    """The index is not a JSON object with a ``weight_map`` of tensor name -> shard file inside its folder."""


class MissingShard(ShardError):
    """A shard the ``weight_map`` names does not exist."""


class TensorNotInShard(ShardError):
    """A tensor the ``weight_map`` names is not in the shard it names."""


class DuplicateTensor(ShardError):
    """One tensor name is in two shards."""


class SplitError(ShardError):
    """A ``gguf-split`` set breaks a rule (README.md, "GGUF"): a missing split, a ``split.no`` out of place, a count."""


class MissingSplit(SplitError):
    """A split of the set is absent."""


class SplitOutOfPlace(SplitError):
    """A split's ``split.no`` or ``split.count`` does not match its place in the set, or is missing."""


class SplitTensorCount(SplitError):
    """The splits hold another number of tensors than ``split.tensors.count`` says."""


class DuplicateSplitTensor(SplitError):
    """One tensor name is in two splits."""


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


class PytorchError(RuleError):
    """A PyTorch checkpoint is refused (SPEC §12): it breaks a rule of its layout, or a bound of the pickle reader.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid PyTorch checkpoint"
    format_name = "PyTorch"


class NotACheckpoint(PytorchError):
    """The file is neither a torch.save zip archive nor the format before it."""

    rule_text = "checkpoint format"
    refutes_format = True


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


class DataFileError(RuleError):
    """A tensor's bytes lie in another file of the model's folder (an ONNX model's external data), and that file
    cannot hold them. Checked for every format by ``model``, once the format has read the header."""

    rule_text = "data file"


class MissingDataFile(DataFileError):
    """The file a tensor's bytes lie in is not there (or is not a regular file)."""


class DataFileTooShort(DataFileError):
    """The file a tensor's bytes lie in ends before them."""


class OnnxError(RuleError):
    """An ONNX model is refused (SPEC §13): its protobuf is broken, or a tensor breaks a rule of onnx's reader.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid ONNX model"
    format_name = "ONNX"


class OnnxUnavailable(OnnxError):
    """The ``onnx`` package, which decodes an ONNX model's messages, is not installed."""

    rule_text = "needs the onnx package"
    refutes_format = True  # a folder's .onnx file is then left in files/, not a model


class TruncatedProtobuf(OnnxError):
    """A field's length or a varint runs past the end of the message holding it, or of the file."""

    rule_text = "protobuf inside the file"


class InvalidProtobuf(OnnxError):
    """The bytes are not protobuf as onnx's messages are: a wire type or field number protobuf has not, a varint
    over 10 bytes, messages nested past protobuf's limit, a message the onnx package refuses to decode."""

    rule_text = "protobuf"


class UnknownDataType(OnnxError):
    """A tensor's ``data_type`` is not one of ``TensorProto.DataType`` (or is ``UNDEFINED``)."""

    rule_text = "known data_type"


class InvalidDims(OnnxError):
    """A tensor's ``dims`` hold a negative number, or their product overflows 64 bits."""

    rule_text = "dims"


class TensorLengthMismatch(OnnxError):
    """A tensor's bytes (``raw_data``, the ``length`` of its external data, the values of its typed field) are not
    its ``dims`` times its type's size."""

    rule_text = "length of dims x the type's size"


class InvalidExternalData(OnnxError):
    """A tensor whose ``data_location`` is ``EXTERNAL`` lacks a ``location``, or its ``offset`` or ``length`` is not
    a non-negative integer."""

    rule_text = "external data"


class LocationOutsideFolder(OnnxError):
    """An external data ``location`` is absolute, empty, or climbs out of the model's folder with ``..``."""

    rule_text = "external data inside the model's folder"


class TypedDataTooLarge(OnnxError):
    """The tensors a model keeps in typed fields (``int32_data``, ...) would need more than stfs holds in memory."""

    rule_text = "typed fields within bounds"


class DcpError(RuleError):
    """A PyTorch Distributed Checkpoint is refused (SPEC §13): its ``.metadata`` or a chunk it names breaks a rule.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid distributed checkpoint"
    format_name = "DCP"


class NotDcpMetadata(DcpError):
    """The file's pickle holds no ``torch.distributed.checkpoint`` ``Metadata`` whose storage is a folder of
    ``.distcp`` files (another pickle, or a checkpoint another storage writer made)."""

    rule_text = "metadata"
    refutes_format = True  # a folder's other .metadata file is left in files/, not a model


class InvalidDcpMetadata(DcpError):
    """A member of the ``Metadata`` is not what torch's DCP writes there (a tensor's size, dtype, chunks; a storage's
    path, offset, length)."""

    rule_text = "metadata"


class TransformedStorage(DcpError):
    """A chunk is stored through a transform (``_StorageInfo.transform_descriptors``: compressed, say), not as the
    bytes ``torch.save`` wrote."""

    rule_text = "untransformed storage"


class ChunkOutsideTensor(DcpError):
    """A chunk's offsets and sizes reach outside its tensor's size (or have another number of dimensions)."""

    rule_text = "chunks inside their tensor"


class OverlappingChunks(DcpError):
    """Two chunks of a tensor hold the same element."""

    rule_text = "chunks that do not overlap"


class ChunksLeaveHole(DcpError):
    """A tensor's chunks do not hold every one of its elements."""

    rule_text = "chunks that cover their tensor"


class MissingChunkStorage(DcpError):
    """A chunk (or a bytes entry) has no ``storage_data`` entry saying where it lies."""

    rule_text = "storage of every chunk"


class StorageOutsideFolder(DcpError):
    """A storage's ``relative_path`` is not a file name of the checkpoint's folder (where torch writes them)."""

    rule_text = "storage inside the folder"


class InvalidChunk(DcpError):
    """A chunk's bytes are not a ``torch.save`` archive of one tensor of its dtype and sizes."""

    rule_text = "chunk of one tensor"
