"""GGUF, llama.cpp's model format: read a header through a range reader and enforce llama.cpp's rules (SPEC §11).

Pure: bytes come through ``read(offset, size)``, no I/O of its own. The checks run in the order llama.cpp's
``gguf_init_from_reader`` (``ggml/src/gguf.cpp``) reads the file, then the model loader's bound on each
tensor's bytes; each refusal is its own ``GgufError`` naming the file, the tensor and the rule.

A GGUF header has no length prefix: ``parse_header`` takes a prefix of the file and raises ``HeaderIncomplete``
with a lower bound on the header's end when the prefix is too short; ``read_header`` grows the prefix so that
a remote header costs at most 4 requests and twice its bytes plus 2 MiB (for headers up to 30 MiB; more
only where the header is larger still), and never reaches past the bytes that bound needs.

Layout (v2 and v3): ``GGUF``, u32 version, u64 tensor count, u64 key/value count, the key/values, the tensor
infos, zero padding to the alignment, the data section. Strings are a u64 length and their bytes. The type
table (names, block sizes) is the ``gguf`` package's, never a copy of it.

A tensor with no dimensions (n_dims 0), which llama.cpp reads as one element, is refused as SPEC §11 says (1 to
4 dimensions). Where the SPEC is silent, as llama.cpp reads it: names are compared as C strings for duplicates
(``a\\0x`` and ``a\\0y`` are one name to ggml); a bool is true for any byte but 0. Names and strings that are not
UTF-8 keep their bytes as surrogate escapes (``os.fsdecode``'s convention): a ``metadata/`` string file holds the
bytes, JSON the ``\\udcXX`` escape. JSON has no NaN or infinity: those float values are the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..base import DType, Format, Header, RangeFetcher, SplitSet, TensorEntry
from .reader import (
    _walk,  # noqa: F401 (the tests' look at the string walk)
    parse_header,
    read_header,
)
from .splits import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, merge_splits, split_set_names
from .texts import encoded_json, header_json, metadata_file, value_json
from .types import (
    ALIGNMENT_KEY,
    CHEAP_BELOW,
    DEFAULT_ALIGNMENT,
    FIRST_READ,
    GGML_QUANT_SIZES,
    GGML_TYPES,
    INT64_MAX,
    LOCAL_FIRST_READ,
    MAGIC,
    MAX_ARRAY_ELEMENTS,
    MAX_DIMS,
    MAX_NAME,
    MAX_STRING_LENGTH,
    SIZE_MAX,
    GGMLQuantizationType,
    GgmlType,
    GgufHeader,
    GgufSplitSet,
    GgufTensor,
    GGUFValueType,
    HeaderIncomplete,
    KeyValue,
    KvValue,
    StringArray,
    ggml_type,
)

# -- the format seam: a GGUF file as every format's Header -------------------------------------------------------


def fetch_header(
    fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = FIRST_READ
) -> Header:
    """Read and validate the GGUF file ``path`` through ``fetch`` (``read_header``) as a ``Header``: GGML type
    names, C-order shapes, metadata files' contents, ``header.json`` made in the safetensors schema; the GGUF
    header itself as ``parsed`` (a split set's checks need its key/values)."""
    cheap = first_read < CHEAP_BELOW  # a local file: reading more costs less than parsing a vocabulary again
    parsed = read_header(fetch, file_size, path=path, first_read=LOCAL_FIRST_READ if cheap else FIRST_READ)
    encoded = {key: encoded_json(kv) for key, kv in parsed.metadata.items()}  # the longest work: done once
    made = header_json(parsed, encoded)
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tuple(TensorEntry(t.name, t.dtype, t.shape, t.offset, t.offset + t.nbytes) for t in parsed.tensors),
        metadata=metadata_texts(parsed.metadata, encoded),
        digest=hashlib.sha256(made).digest(),
        data_start=parsed.data_offset,
        json_made=made,
        parsed=parsed,
    )


def metadata_texts(metadata: Mapping[str, KeyValue], encoded: Mapping[str, bytes] | None = None) -> dict[str, str]:
    """Each key's ``metadata/KEY`` content less its newline, as text (bytes that are not UTF-8 as surrogate
    escapes, which the tree writes back as those bytes); ``encoded``: each key's ``encoded_json``, made already."""
    found = {}
    for key, kv in metadata.items():
        if kv.type == GGUFValueType.STRING:
            found[key] = metadata_file(kv)[:-1].decode("utf-8", "surrogateescape")
        elif kv.text is not None:
            found[key] = kv.text  # the JSON of strings that are all UTF-8: nothing to escape
        else:
            found[key] = (encoded[key] if encoded is not None else encoded_json(kv)).decode("utf-8")
    return found


class _Gguf(Format):
    name = "gguf"
    title = "GGUF"
    head_size = 4

    def sniff(self, head: bytes) -> bool:
        return head[:4] == MAGIC

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def dtype(self, name: str) -> DType | None:
        """A GGML type by gguf-py's name: its block, and its decoding where the ``gguf`` package has one."""
        try:
            found = ggml_type(name)
        except KeyError:
            return None
        decode = _decoder(found) if found.dequantizable else None
        return DType(found.name, found.block_size, found.type_size, has_values=decode is not None, decode=decode)

    def split_set(self, file_name: str) -> tuple[str, list[str]] | None:
        return split_set_names(file_name)

    def merge_split_set(self, name: str, files: Sequence[str], headers: Sequence[Header | None]) -> SplitSet:
        merged = merge_splits(name, files, [header.parsed if header else None for header in headers])
        return SplitSet(metadata_texts(merged.metadata), header_json(merged))


def _decoder(kind: GgmlType) -> Callable[[memoryview, memoryview], None]:
    """Decoding whole blocks of ``kind`` to float32: ``gguf.quants.dequantize``, as ggml computes them."""
    from gguf.constants import GGMLQuantizationType as PackageType  # the package's own, which dequantize keys by
    from gguf.quants import dequantize

    qtype = PackageType(kind.id)

    def decode(source: memoryview, out: memoryview) -> None:
        with np.errstate(all="ignore"):  # NaN and inf scales give NaN and inf values, as ggml's do: no warning
            values = dequantize(np.frombuffer(source, dtype=np.uint8), qtype).reshape(-1)
            np.copyto(np.frombuffer(out, dtype=np.float32), values)

    return decode


FORMAT: Format = _Gguf()

__all__ = [
    "ALIGNMENT_KEY",
    "CHEAP_BELOW",
    "DEFAULT_ALIGNMENT",
    "FIRST_READ",
    "FORMAT",
    "GGMLQuantizationType",
    "GGML_QUANT_SIZES",
    "GGML_TYPES",
    "GGUFValueType",
    "GgmlType",
    "GgufHeader",
    "GgufSplitSet",
    "GgufTensor",
    "HeaderIncomplete",
    "INT64_MAX",
    "KeyValue",
    "KvValue",
    "LOCAL_FIRST_READ",
    "MAGIC",
    "MAX_ARRAY_ELEMENTS",
    "MAX_DIMS",
    "MAX_NAME",
    "MAX_STRING_LENGTH",
    "SIZE_MAX",
    "SPLIT_COUNT",
    "SPLIT_NO",
    "SPLIT_TENSORS_COUNT",
    "StringArray",
    "encoded_json",
    "fetch_header",
    "ggml_type",
    "header_json",
    "merge_splits",
    "metadata_file",
    "metadata_texts",
    "parse_header",
    "read_header",
    "split_set_names",
    "value_json",
]
