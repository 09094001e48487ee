"""Errors of stfs: the bases (``StfsError``, ``FormatError``, ``RuleError``), the errors every format and source
shares (a short file, a missing data file, shards, sources, mounting), and safetensors' rules: one ``FormatError``
subclass per rule of SPEC §4 (docs/validation.md), named like the safetensors reference (``tensor.rs``) names its
errors, so a message says which file, which tensor and which rule. Every other format's rule errors live with it
(``formats/gguf/rules.py``, ``formats/pytorch/rules.py``, ``formats/dcp/rules.py``, ``formats/onnx.py``,
``formats/npz.py``).
"""

from __future__ import annotations


class StfsError(Exception):
    """An error the command line reports as one line and exit code 1."""

    @property
    def message(self) -> str:
        return str(self)


CUT_SHORT = "the file is shorter than it says it is (a download or copy cut short?): fetch it again"


class FormatError(StfsError):
    """A safetensors file breaks a validation rule; ``rule`` is its number."""

    rule = 0
    title = "invalid safetensors file"
    refutes_format = False  # the file is not of the format at all (a zip that is no checkpoint), not a broken one
    # what to do instead, said after what is wrong (``RuleError``: its own words)
    advice = "the safetensors package refuses it too: write it again with safetensors' save_file"

    def __init__(self, path: str, detail: str, tensor: str | None = None, *, first_bytes: bytes | None = None) -> None:
        self.path = path
        self.detail = detail
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        rule = f"rule {self.rule} ({type(self).__name__}): {detail}"
        if first_bytes is not None:  # no safetensors file at all (a text file so named): said first, as of no format
            super().__init__(f"{where}not a safetensors file: its first bytes are {first_bytes!r} ({rule})")
        else:
            super().__init__(f"{where}{rule}: stfs cannot mount this safetensors file; {self.advice}")


class HeaderTooSmall(FormatError):
    """The file is shorter than the 8-byte header length."""

    advice = CUT_SHORT

    rule = 1


class HeaderTooLarge(FormatError):
    """The header length exceeds 100,000,000 bytes."""

    rule = 2


class InvalidHeaderLength(FormatError):
    """The header runs past the end of the file."""

    advice = CUT_SHORT

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

    advice = "the file is not the length its header says (cut short, or bytes added after?): fetch it again"

    rule = 11


class RuleError(FormatError):
    """A refusal named by its rule in a few words (``rule_text``), not by a safetensors rule number, read as one
    sentence: the file and the tensor where there is one, what is wrong (``detail``), that stfs cannot mount it as
    the kind of file it is (``format_name``), the rule, and what to do instead (``advice``)::

        /m/a.npz: entry 'a.npy' is compressed (method 8), as np.savez_compressed writes it: stfs cannot mount this
        NumPy .npy/.npz file, by its rule 'stored members' (CompressedMember); ... save it again with np.savez ...
    """

    format_name = ""  # the kind of file, as a sentence names it: "NumPy .npz file", "GGUF file"
    rule_text = ""
    # what to do instead, a clause; ``{path}`` is the file's path, ``{stem}`` that path less its last suffix
    advice = ""

    def __init__(self, path: str, detail: str, tensor: str | None = None) -> None:
        self.path = path
        self.detail = detail
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        if not self.format_name:
            kind = "this file"
        elif self.refutes_format:  # not of the format at all: it is no such file
            kind = f"it as a {self.format_name}"
        else:
            kind = f"this {self.format_name}"
        rule = f", by its rule '{self.rule_text}'" if self.rule_text else ""
        stem = path.rpartition(".")[0] if "." in path.rpartition("/")[2] else path
        advice = f"; {self.advice.format(path=path, stem=stem)}" if self.advice else ""
        message = f"{where}{detail.rstrip('.')}: stfs cannot mount {kind}{rule} ({type(self).__name__}){advice}"
        StfsError.__init__(self, message)


class TruncatedFile(RuleError):
    """The file ends before something its own structure says is there (``formats.base.read_exact``); a format may
    word it as its own error (a checkpoint's ``CheckpointTruncated``)."""

    advice = CUT_SHORT

    rule_text = "bytes inside the file"


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


class DataFileError(RuleError):
    """A tensor's bytes lie in another file of the model's folder (an ONNX model's external data), and that file
    cannot hold them. Checked for every format by ``model``, once the format has read the header."""

    rule_text = "data file"
    advice = "fetch that file again, and keep it beside the model, where the model names it"


class MissingDataFile(DataFileError):
    """The file a tensor's bytes lie in is not there (or is not a regular file)."""

    advice = "put that file beside the model, where the model names it, as its writer left it"


class DataFileTooShort(DataFileError):
    """The file a tensor's bytes lie in ends before them."""

    advice = "that file is shorter than the model says (a download or copy cut short?): fetch it again"


class FormatBug(StfsError):
    """A format's reader returned a header that breaks what every format promises (``formats.seam``): a bug in stfs,
    named as such, never served."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}: a bug in stfs, not in the file (please report it)")
