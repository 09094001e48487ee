"""A PyTorch checkpoint's rule errors (SPEC §12, docs/pytorch.md): one per rule of its layout or bound of the
pickle reader."""

from __future__ import annotations

from ...errors import CUT_SHORT, RuleError


class PytorchError(RuleError):
    """A PyTorch checkpoint is refused (SPEC §12): it breaks a rule of its layout, or a bound of the pickle reader.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid PyTorch checkpoint"
    format_name = "PyTorch checkpoint"
    advice = "torch.load cannot read it either: save the state_dict again with torch.save"


class NotACheckpoint(PytorchError):
    """The file is neither a torch.save zip archive nor the format before it."""

    rule_text = "checkpoint format"
    refutes_format = True


class LegacyTarCheckpoint(PytorchError):
    """The tar format of PyTorch 0.x, which current torch cannot load with ``weights_only`` either."""

    rule_text = "checkpoint format"
    advice = "torch.load still reads it: re-save it with a current torch (torch.save(torch.load(old), new))"


class TorchScriptArchive(PytorchError):
    """A ``torch.jit.save`` archive (``constants.pkl``, ``code/``): a program, not a checkpoint."""

    rule_text = "not TorchScript"
    advice = "torch.jit.save wrote it: load it with torch.jit.load and torch.save its state_dict()"


class BigEndianCheckpoint(PytorchError):
    """A checkpoint whose ``byteorder`` record (or legacy ``sys_info``) says big-endian."""

    rule_text = "little-endian data"
    advice = "load it with torch.load and save it again on a little-endian machine"


class CheckpointTruncated(PytorchError):
    """The file ends before something its own structure says is there."""

    rule_text = "bytes inside the file"
    advice = CUT_SHORT


class InvalidZipArchive(PytorchError):
    """The zip structure is broken: end records, central directory, a local header, a duplicate or missing entry."""

    rule_text = "zip archive"


class EntryOutsideArchive(PytorchError):
    """An entry lies outside the archive's one top folder (or its name climbs out with ``..``)."""

    rule_text = "one top folder"


class CompressedEntry(PytorchError):
    """An entry stfs must read or serve is compressed (or encrypted), not stored."""

    rule_text = "stored entries"
    advice = "torch.save stores every entry as it is: load it with torch.load and save it again with torch.save"


class InvalidPickle(PytorchError):
    """The pickle is malformed: an unknown opcode, a stack or memo that does not hold what an opcode needs."""

    rule_text = "pickle"


class PickleLimitExceeded(PytorchError):
    """A bound of the pickle reader is exceeded: opcodes, memo entries, nesting, a walk of the structure, a name."""

    rule_text = "pickle within bounds"
    advice = "a checkpoint of tensors is far smaller: save its state_dict alone with torch.save"


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
