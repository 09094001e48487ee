"""A PyTorch Distributed Checkpoint's rule errors (SPEC §13, docs/dcp.md)."""

from __future__ import annotations

from ...errors import RuleError


class DcpError(RuleError):
    """A PyTorch Distributed Checkpoint is refused (SPEC §13): its ``.metadata`` or a chunk it names breaks a rule.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid distributed checkpoint"
    format_name = "PyTorch Distributed Checkpoint"
    advice = (
        "torch.distributed.checkpoint.load cannot read it either: save it again with torch.distributed.checkpoint.save"
    )


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
    advice = "save it again without a storage transform (compression, encryption) on torch.distributed.checkpoint.save"


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
    advice = "copy every .distcp file of the checkpoint into the folder of its .metadata"


class StorageOutsideFolder(DcpError):
    """A storage's ``relative_path`` is not a file name of the checkpoint's folder (where torch writes them)."""

    rule_text = "storage inside the folder"


class InvalidChunk(DcpError):
    """A chunk's bytes are not a ``torch.save`` archive of one tensor of its dtype and sizes."""

    rule_text = "chunk of one tensor"
