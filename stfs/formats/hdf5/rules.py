"""HDF5's rule errors: one per rule of the HDF Group's file format specification that a file breaks, and one per
kind of dataset stfs cannot serve as a tensor's bytes (docs/hdf5.md)."""

from __future__ import annotations

from ...errors import RuleError


class Hdf5Error(RuleError):
    """An HDF5 file breaks a rule of the file format specification, or holds a dataset a tensor file cannot serve."""

    rule_text = "invalid HDF5 file"
    format_name = "HDF5 file"
    advice = "h5py cannot read it whole either: write it again with h5py or Keras (model.save_weights)"


class NoSuperblock(Hdf5Error):
    """No superblock signature at byte 0, 512, 1024, 2048, ... of the file: not an HDF5 file."""

    rule_text = "superblock signature"
    advice = "if it is HDF5 with a user block larger than 2 KiB, name it .h5 so stfs looks further"
    refutes_format = True


class BadSuperblock(Hdf5Error):
    """A superblock of a version the specification does not define (0 to 3), sizes other than 2, 4 or 8, or a
    checksum that does not match."""

    rule_text = "superblock"
    advice = "check it with h5dump or h5py; copy it again if it was cut or changed in transit"


class Hdf5Truncated(Hdf5Error):
    """A structure (an object header, a B-tree node, a heap, a dataset's bytes) lies past the end of the file."""

    rule_text = "structures inside the file"
    advice = "the file was cut short: copy or download it again whole"


class BadStructure(Hdf5Error):
    """An object header, B-tree, heap or message is not what the specification says is there: a wrong signature,
    version or checksum, a field out of its range, a walk that comes back to where it was."""

    rule_text = "file structure"


class TooLarge(Hdf5Error):
    """The file's structures need more work or memory than stfs gives one header: more objects, nodes or metadata
    bytes than its bounds."""

    rule_text = "bounded metadata"
    advice = "split the weights over several files (Keras' sharded weights, or one file per layer)"


class FilteredDataset(Hdf5Error):
    """A dataset stored through filters (gzip, lzf, shuffle, szip, Fletcher32, ...): its bytes in the file are not
    its values."""

    rule_text = "unfiltered datasets"
    advice = "write it again without compression: h5py create_dataset(..., compression=None), or h5repack -f NONE"


class UnsupportedType(Hdf5Error):
    """A dataset of a type a tensor cannot hold: big-endian, compound, string, variable-length, reference, enum,
    array, time, bitfield, or a number of a width safetensors has no dtype for."""

    rule_text = "numeric datasets"
    advice = "save the weights as little-endian numbers (numpy astype('<f4')), or load them with h5py"


class UnsupportedStorage(Hdf5Error):
    """A dataset whose bytes are not in this file as stfs serves them: external storage, a virtual dataset, a chunk
    index stfs does not read, chunks never written."""

    rule_text = "stored datasets"
    advice = "copy the data into this file: h5repack -l CONTI IN OUT writes every dataset contiguous"
