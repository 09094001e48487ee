"""GGUF's rule errors: one per rule of llama.cpp's reader (docs/gguf.md), and a gguf-split set's."""

from __future__ import annotations

from ...errors import CUT_SHORT, RuleError, ShardError


class GgufError(RuleError):
    """A GGUF file breaks a rule of llama.cpp's reader (README.md, "GGUF"); ``rule`` names it in a few words."""

    rule_text = "invalid GGUF file"
    format_name = "GGUF file"
    advice = "llama.cpp refuses it too: download it again, or convert the model again (convert_hf_to_gguf.py)"


class GgufTruncated(GgufError):
    """The file ends inside a fixed-size field of the header (llama.cpp: reading past the end fails)."""

    rule_text = "header inside the file"
    advice = CUT_SHORT


class InvalidMagic(GgufError):
    """The file does not start with ``GGUF``."""

    rule_text = "magic"


class UnsupportedVersion(GgufError):
    """The version is 0 or above 3."""

    rule_text = "version 2 or 3"
    advice = "llama.cpp reads versions 2 and 3 only: convert the model again with a current llama.cpp"


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
    advice = "its type is newer than the gguf package stfs reads with (pip install -U gguf), or not GGUF's at all"


class RowNotBlockMultiple(GgufError):
    """The first dimension is not a multiple of the type's block size."""

    rule_text = "rows of whole blocks"


class GgufOverflow(GgufError):
    """An element count, a byte size or the running data size does not fit (INT64_MAX, SIZE_MAX)."""

    rule_text = "no overflow"


class DataSectionOutOfFile(GgufError):
    """The data section's start, padded to the alignment, lies past the end of the file."""

    rule_text = "data section inside the file"
    advice = CUT_SHORT


class TensorOffsetMismatch(GgufError):
    """A tensor's offset is not the sum of the padded sizes of the tensors before it."""

    rule_text = "tensor offsets"


class TensorOutOfFile(GgufError):
    """A tensor's bytes run past the end of the file (llama.cpp's model loader check)."""

    rule_text = "tensor data inside the file"
    advice = CUT_SHORT


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
