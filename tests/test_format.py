"""The header reader: one broken file per validation rule (docs/validation.md), every valid file shape, hostile
headers."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from stfs import errors
from stfs.formats.safetensors import DTYPE_BITS, MAX_HEADER_LENGTH, U64_MAX, Header
from stfs.model import read_header
from tests.models import RAW_DTYPES, rich_arrays, tensor_bytes, write_header, write_numpy, write_raw

NUMPY_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(bool): "BOOL",
    np.dtype(np.complex64): "C64",
}


def tensor(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def broken(
    tmp_path: Path, header: Any = None, data: bytes = b"", length: int | None = None, raw: bytes | None = None
) -> str:
    return write_header(str(tmp_path / "broken.safetensors"), header, data=data, length=length, raw=raw)


def refused(path: str, error: type[errors.FormatError], rule: int, tensor: str | None = None) -> errors.FormatError:
    """Read ``path``, which must break ``rule`` with exactly ``error``, naming the file and the tensor."""
    with pytest.raises(errors.FormatError) as caught:
        read_header(path)
    exc = caught.value
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    assert exc.rule == rule
    message = exc.message
    assert message.startswith(f"{path}: "), message
    assert f"rule {rule} " in message
    assert "\n" not in message
    assert len(message) < 600, message
    assert exc.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in message
    return exc


# -- rule 1: at least 8 bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7])
def test_rule1_fewer_than_8_bytes(tmp_path: Path, size: int) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02" * size)
    refused(str(path), errors.HeaderTooSmall, 1)


# -- rule 2: N <= 100,000,000 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [MAX_HEADER_LENGTH + 1, 2**63, U64_MAX])
def test_rule2_header_length_over_limit(tmp_path: Path, length: int) -> None:
    exc = refused(broken(tmp_path, {}, length=length), errors.HeaderTooLarge, 2)
    assert str(length) in exc.message


def test_rule2_of_a_file_that_is_no_safetensors_file_says_so_and_shows_its_first_bytes(tmp_path: Path) -> None:
    """A text file named .safetensors: its first 8 bytes read as a length, far past the limit, and no ``{`` after
    them. The line says what it is, as for a file of no format (it was only "header length 3475222254926655346
    exceeds the limit")."""
    path = tmp_path / "notes.safetensors"
    path.write_text("These are notes, not weights.\n")
    exc = refused(str(path), errors.HeaderTooLarge, 2)
    assert exc.message == (
        f"{path}: not a safetensors file: its first bytes are b'These ar' (rule 2 (HeaderTooLarge): header length "
        f"{int.from_bytes(b'These ar', 'little')} exceeds the limit of 100000000)"
    )


def test_rule2_limit_itself_is_allowed_then_rule3_applies(tmp_path: Path) -> None:
    refused(broken(tmp_path, {}, length=MAX_HEADER_LENGTH), errors.InvalidHeaderLength, 3)


# -- rule 3: 8 + N <= file size ---------------------------------------------------------------------------------------


def test_rule3_header_runs_past_end_of_file(tmp_path: Path) -> None:
    body = b"{}"
    refused(broken(tmp_path, raw=body, length=len(body) + 1), errors.InvalidHeaderLength, 3)


def test_rule3_length_only(tmp_path: Path) -> None:
    refused(broken(tmp_path, raw=b"", length=1), errors.InvalidHeaderLength, 3)


# -- rule 4: UTF-8, begins with '{' ----------------------------------------------------------------------------------


def test_rule4_not_utf8(tmp_path: Path) -> None:
    raw = b'{"caf\xe9":' + json.dumps(tensor("U8", [1], 0, 1)).encode() + b"}"
    refused(broken(tmp_path, raw=raw, data=b"\0"), errors.InvalidHeaderUtf8, 4)


def test_rule4_utf8_encoded_surrogate_is_not_utf8(tmp_path: Path) -> None:
    refused(broken(tmp_path, raw=b'{"\xed\xa0\x80":1}'), errors.InvalidHeaderUtf8, 4)


@pytest.mark.parametrize("raw", [b"", b" {}", b"[]", b"\xef\xbb\xbf{}", b"null", b"\n{}", b"\x00{}"])
def test_rule4_does_not_begin_with_brace(tmp_path: Path, raw: bytes) -> None:
    refused(broken(tmp_path, raw=raw), errors.InvalidHeaderStart, 4)


# -- rule 5: valid JSON, no duplicate keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b'{"a":}',
        b"{'a': 1}",
        b"{} {}",
        b"{}x",
        b'{"a":1,}',
        b'{"a":"line\nbreak"}',  # a raw control character in a string
        b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":NaN}}',
        b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":-Infinity}}',
        b'{"a":01}',
        b'{"a":"\\x"}',
    ],
)
def test_rule5_invalid_json(tmp_path: Path, raw: bytes) -> None:
    exc = refused(broken(tmp_path, raw=raw), errors.InvalidHeaderDeserialization, 5)
    assert "invalid JSON" in exc.message


def test_rule5_duplicate_tensor_name(tmp_path: Path) -> None:
    entry = json.dumps(tensor("U8", [2], 0, 2))
    raw = f'{{"w":{entry},"w":{entry}}}'.encode()
    exc = refused(broken(tmp_path, raw=raw, data=b"ab"), errors.DuplicateKey, 5, tensor="w")
    assert "tensor name appears twice" in exc.message


def test_rule5_second_metadata_is_named_as_such(tmp_path: Path) -> None:
    exc = refused(broken(tmp_path, raw=b'{"__metadata__":{},"__metadata__":{"a":"b"}}'), errors.DuplicateKey, 5)
    assert "__metadata__ appears twice" in exc.message and "tensor name" not in exc.message


def test_rule5_duplicate_key_inside_a_tensor(tmp_path: Path) -> None:
    raw = b'{"w":{"dtype":"U8","shape":[2],"dtype":"U8","data_offsets":[0,2]}}'
    exc = refused(broken(tmp_path, raw=raw, data=b"ab"), errors.DuplicateKey, 5, tensor="w")
    assert "'dtype'" in exc.message


def test_rule5_duplicate_key_deep_inside_an_ignored_member(tmp_path: Path) -> None:
    raw = b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":[{"k":1,"k":2}]}}'
    exc = refused(broken(tmp_path, raw=raw, data=b"ab"), errors.DuplicateKey, 5, tensor="w")
    assert "'k'" in exc.message


def test_rule5_duplicate_metadata_key(tmp_path: Path) -> None:
    raw = b'{"__metadata__":{"format":"pt","format":"np"}}'
    exc = refused(broken(tmp_path, raw=raw), errors.DuplicateKey, 5)
    assert "'format'" in exc.message and "__metadata__" in exc.message


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\udfff", b"\\uDBFFx", b"\\udc00\\ud800"])
def test_rule5_lone_surrogate_escape_in_a_name(tmp_path: Path, escape: bytes) -> None:
    # serde_json, and so the reference, refuses these; no file name could hold one.
    raw = b'{"w' + escape + b'":' + json.dumps(tensor("U8", [0], 0, 0)).encode() + b"}"
    name = json.loads(b'"w' + escape + b'"')
    exc = refused(broken(tmp_path, raw=raw), errors.InvalidHeaderDeserialization, 5, tensor=name)
    assert "surrogate" in exc.message


def test_rule5_lone_surrogate_in_metadata(tmp_path: Path) -> None:
    refused(broken(tmp_path, raw=b'{"__metadata__":{"k":"\\ud834"}}'), errors.InvalidHeaderDeserialization, 5)


def test_surrogate_pair_escape_and_escaped_backslash_are_fine(tmp_path: Path) -> None:
    raw = (
        b'{"\\ud83e\\udd80":'
        + json.dumps(tensor("U8", [1], 0, 1)).encode()
        + b',"__metadata__":{"path":"C:\\\\ud800"}}'
    )
    header = read_header(broken(tmp_path, raw=raw, data=b"x"))
    assert [t.name for t in header.tensors] == ["\U0001f980"]
    assert header.metadata == {"path": "C:\\ud800"}


# -- rule 6: __metadata__ is a flat str -> str map -------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [[], "pt", 1, True, {"a": 1}, {"a": None}, {"a": True}, {"a": ["x"]}, {"a": {"b": "c"}}, {"ok": "1", "bad": 2.5}],
)
def test_rule6_metadata_not_flat_string_map(tmp_path: Path, metadata: Any) -> None:
    refused(broken(tmp_path, {"__metadata__": metadata}), errors.InvalidMetadata, 6)


def test_null_metadata_is_no_metadata(tmp_path: Path) -> None:
    # The reference reads __metadata__ as Option<HashMap>, so null is accepted.
    header = read_header(broken(tmp_path, {"__metadata__": None, "w": tensor("U8", [1], 0, 1)}, data=b"x"))
    assert header.metadata == {}
    assert [t.name for t in header.tensors] == ["w"]


# -- rule 7: dtype, shape, data_offsets ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["F128", "bf16", "f32", "", " F32", "FLOAT", "F8", "F6", "Q4_0", None, 32, ["F32"]])
def test_rule7_unknown_dtype(tmp_path: Path, dtype: Any) -> None:
    refused(broken(tmp_path, {"w": tensor(dtype, [1], 0, 4)}, data=b"\0" * 4), errors.MalformedTensorInfo, 7, "w")


def test_rule7_missing_dtype(tmp_path: Path) -> None:
    header = {"w": {"shape": [1], "data_offsets": [0, 4]}}
    refused(broken(tmp_path, header, data=b"\0" * 4), errors.MalformedTensorInfo, 7, "w")


@pytest.mark.parametrize(
    "shape",
    [[-1], [2, -3], [1.0], [2.5], [True], [False, 1], ["2"], [None], [[1]], 4, "4", {"0": 4}, None, -0.0],
)
def test_rule7_bad_shape(tmp_path: Path, shape: Any) -> None:
    refused(broken(tmp_path, {"w": tensor("U8", shape, 0, 4)}, data=b"\0" * 4), errors.MalformedTensorInfo, 7, "w")


def test_rule7_negative_zero_is_not_an_integer(tmp_path: Path) -> None:
    # serde_json reads -0 as a float, which the reference refuses as a usize.
    raw = b'{"w":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'
    refused(broken(tmp_path, raw=raw), errors.MalformedTensorInfo, 7, "w")


def test_rule7_dimension_beyond_64_bits(tmp_path: Path) -> None:
    refused(broken(tmp_path, {"w": tensor("U8", [2**64], 0, 0)}), errors.MalformedTensorInfo, 7, "w")
    refused(broken(tmp_path, {"w": tensor("U8", [10**30], 0, 0)}), errors.MalformedTensorInfo, 7, "w")


def test_rule7_missing_shape(tmp_path: Path) -> None:
    header = {"w": {"dtype": "U8", "data_offsets": [0, 1]}}
    refused(broken(tmp_path, header, data=b"x"), errors.MalformedTensorInfo, 7, "w")


@pytest.mark.parametrize(
    "offsets",
    [[], [0], [0, 1, 2], [-1, 0], [0, -1], [0.0, 1], [0, 1.0], [False, True], "0,1", {"0": 1}, None, [0, 2**64]],
)
def test_rule7_bad_data_offsets(tmp_path: Path, offsets: Any) -> None:
    header = {"w": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}
    refused(broken(tmp_path, header, data=b"x"), errors.MalformedTensorInfo, 7, "w")


@pytest.mark.parametrize("info", [[], "U8", 1, None, True])
def test_rule7_tensor_info_not_an_object(tmp_path: Path, info: Any) -> None:
    refused(broken(tmp_path, {"w": info}), errors.MalformedTensorInfo, 7, "w")


def test_rule7_names_the_broken_tensor_not_its_neighbour(tmp_path: Path) -> None:
    header = {"good": tensor("U8", [1], 0, 1), "bad": tensor("U8", [-1], 1, 2)}
    refused(broken(tmp_path, header, data=b"xy"), errors.MalformedTensorInfo, 7, "bad")


def test_other_members_are_ignored(tmp_path: Path) -> None:
    info = {**tensor("U8", [2], 0, 2), "quant": {"scheme": [1, 2, {"x": None}]}, "note": "hi"}
    header = read_header(broken(tmp_path, {"w": info}, data=b"ab"))
    assert header.tensors[0].shape == (2,)


# -- rule 8: element count x bits is a multiple of 8; overflow --------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape", "bits"),
    [
        ("F4", [3], 12),
        ("F4", [1], 4),
        ("F4", [3, 5], 60),
        ("F6_E2M3", [1], 6),
        ("F6_E2M3", [3], 18),
        ("F6_E3M2", [5], 30),
        ("F6_E3M2", [2, 1], 12),
    ],
)
def test_rule8_sub_byte_dtype_not_whole_bytes(tmp_path: Path, dtype: str, shape: list[int], bits: int) -> None:
    size = bits // 8 + 1
    exc = refused(
        broken(tmp_path, {"w": tensor(dtype, shape, 0, size)}, data=b"\0" * size), errors.MisalignedSlice, 8, "w"
    )
    assert f"{bits} bits" in exc.message


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ([2**40, 2**40], "U8"),
        ([2**32, 2**32], "U8"),
        ([10**9, 10**9, 10**9], "F32"),
        ([U64_MAX, 2], "BOOL"),
        ([2**62], "F64"),
        ([2**61], "I32"),
        ([U64_MAX], "F4"),
    ],
)
def test_rule8_overflow_is_an_error_not_a_wrap(tmp_path: Path, shape: list[int], dtype: str) -> None:
    # 2**32 * 2**32 wraps to 0 in 64 bits, which would match data_offsets [0, 0].
    exc = refused(broken(tmp_path, {"w": tensor(dtype, shape, 0, 0)}), errors.ValidationOverflow, 8, "w")
    assert "overflow" in exc.message


def test_overflowing_dimensions_after_a_zero_are_still_refused(tmp_path: Path) -> None:
    # The reference multiplies left to right with checked_mul: 0 first never overflows, a zero at the end is too late.
    header = read_header(broken(tmp_path, {"w": tensor("U8", [0, U64_MAX, U64_MAX], 0, 0)}))
    assert header.tensors[0].parameters == 0
    refused(broken(tmp_path, {"w": tensor("U8", [U64_MAX, U64_MAX, 0], 0, 0)}), errors.ValidationOverflow, 8, "w")


# -- rule 9: end - begin equals the size -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape", "end"),
    [
        ("F32", [2], 4),
        ("F32", [2], 12),
        ("U8", [], 0),
        ("F32", [0], 4),
        ("F4", [4], 4),
        ("F6_E2M3", [4], 4),
        ("C64", [1], 4),
        ("BF16", [3, 3], 17),
    ],
)
def test_rule9_offsets_disagree_with_size(tmp_path: Path, dtype: str, shape: list[int], end: int) -> None:
    exc = refused(
        broken(tmp_path, {"w": tensor(dtype, shape, 0, end)}, data=b"\0" * end), errors.TensorInvalidInfo, 9, "w"
    )
    assert f"span {end} bytes" in exc.message


# -- rule 10: contiguous from 0, no gap, no overlap ------------------------------------------------------------------


def test_rule10_first_tensor_not_at_zero(tmp_path: Path) -> None:
    refused(broken(tmp_path, {"w": tensor("U8", [4], 4, 8)}, data=b"\0" * 8), errors.InvalidOffset, 10, "w")


def test_rule10_gap(tmp_path: Path) -> None:
    header = {"a": tensor("F32", [1], 0, 4), "b": tensor("F32", [1], 8, 12)}
    exc = refused(broken(tmp_path, header, data=b"\0" * 12), errors.InvalidOffset, 10, "b")
    assert "gap" in exc.message


def test_rule10_overlap(tmp_path: Path) -> None:
    header = {"a": tensor("F32", [2], 0, 8), "b": tensor("F32", [2], 4, 12)}
    exc = refused(broken(tmp_path, header, data=b"\0" * 12), errors.InvalidOffset, 10, "b")
    assert "overlap" in exc.message


def test_rule10_two_tensors_on_the_same_bytes(tmp_path: Path) -> None:
    header = {"a": tensor("F32", [1], 0, 4), "b": tensor("F32", [1], 0, 4)}
    refused(broken(tmp_path, header, data=b"\0" * 4), errors.InvalidOffset, 10, "b")


def test_rule10_zero_size_tensor_inside_another(tmp_path: Path) -> None:
    header = {"a": tensor("F32", [2], 0, 8), "z": tensor("F32", [0], 4, 4)}
    refused(broken(tmp_path, header, data=b"\0" * 8), errors.InvalidOffset, 10, "z")


def test_rule10_end_before_begin(tmp_path: Path) -> None:
    refused(broken(tmp_path, {"w": tensor("U8", [0], 4, 0)}, data=b"\0" * 4), errors.InvalidOffset, 10, "w")


def test_rule10_order_in_header_does_not_matter(tmp_path: Path) -> None:
    header = {"b": tensor("U8", [2], 3, 5), "a": tensor("U8", [3], 0, 3)}
    parsed = read_header(broken(tmp_path, header, data=b"aaabb"))
    assert [t.name for t in parsed.tensors] == ["b", "a"]  # header order is kept


# -- rule 11: no trailing bytes ---------------------------------------------------------------------------------------


def test_rule11_trailing_bytes(tmp_path: Path) -> None:
    exc = refused(
        broken(tmp_path, {"w": tensor("U8", [4], 0, 4)}, data=b"\0" * 5), errors.MetadataIncompleteBuffer, 11, "w"
    )  # the tensor the stray bytes follow
    assert "4" in exc.message and "5" in exc.message


def test_rule11_data_shorter_than_the_tensors(tmp_path: Path) -> None:
    refused(broken(tmp_path, {"w": tensor("U8", [4], 0, 4)}, data=b"\0" * 3), errors.MetadataIncompleteBuffer, 11, "w")


def test_rule11_no_tensors_but_data(tmp_path: Path) -> None:
    refused(broken(tmp_path, {}, data=b"\0"), errors.MetadataIncompleteBuffer, 11)


def test_rule11_valid_file_with_one_byte_appended(tmp_path: Path) -> None:
    path = write_numpy(str(tmp_path / "m.safetensors"), {"w": np.arange(6, dtype=np.float32)})
    read_header(path)
    with open(path, "ab") as stream:
        stream.write(b"\0")
    refused(path, errors.MetadataIncompleteBuffer, 11, "w")


def test_rule11_valid_file_truncated_by_one_byte(tmp_path: Path) -> None:
    path = write_numpy(str(tmp_path / "m.safetensors"), {"w": np.arange(6, dtype=np.float32)})
    os.truncate(path, os.path.getsize(path) - 1)
    refused(path, errors.MetadataIncompleteBuffer, 11, "w")


# -- not a file -------------------------------------------------------------------------------------------------------


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.safetensors")
    with pytest.raises(errors.UnreadableFile, match="nope.safetensors"):
        read_header(path)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(errors.UnreadableFile, match=str(tmp_path)):
        read_header(str(tmp_path))


# -- valid files ------------------------------------------------------------------------------------------------------


def document_bytes(path: str) -> bytes:
    """The header bytes of a safetensors file, padding included."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        return stream.read(length)


def check_against_file(header: Header, path: str) -> None:
    """Every entry of ``header`` agrees with the file read independently (struct + json)."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        document = json.loads(stream.read(length))
    assert header.data_start == 8 + length
    assert header.json_at == (8, len(document_bytes(path).rstrip(b" ")))
    assert header.file_size == os.path.getsize(path)
    assert header.data_size == header.file_size - 8 - length
    assert header.metadata == document.pop("__metadata__", {})
    assert [t.name for t in header.tensors] == list(document)
    for entry in header.tensors:
        info = document[entry.name]
        assert entry.dtype == info["dtype"]
        assert list(entry.shape) == info["shape"]
        assert [entry.begin, entry.end] == info["data_offsets"]
        assert entry.size * 8 == entry.parameters * DTYPE_BITS[entry.dtype]


def test_every_numpy_dtype(tmp_path: Path) -> None:
    arrays = rich_arrays()
    path = write_numpy(str(tmp_path / "rich.safetensors"), arrays)
    header = read_header(path)
    check_against_file(header, path)
    assert {t.name for t in header.tensors} == set(arrays)
    for entry in header.tensors:
        array = arrays[entry.name]
        assert entry.dtype == NUMPY_DTYPES[array.dtype]
        assert entry.shape == array.shape
        assert entry.size == array.nbytes
        assert entry.parameters == array.size
        assert tensor_bytes(path, entry.name) == array.tobytes()
    assert sorted(NUMPY_DTYPES.values()) == sorted({t.dtype for t in header.tensors})
    assert load_file(path).keys() == arrays.keys()  # the reference agrees the fixture is valid


def test_zero_rank_and_empty(tmp_path: Path) -> None:
    header = read_header(write_numpy(str(tmp_path / "m.safetensors"), rich_arrays()))
    by_name = {t.name: t for t in header.tensors}
    assert by_name["scalar"].shape == ()
    assert by_name["scalar"].parameters == 1
    assert by_name["scalar"].size == 4
    assert by_name["empty"].shape == (0, 4)
    assert by_name["empty"].parameters == 0
    assert by_name["empty"].size == 0


def test_only_empty_tensors_and_no_tensors(tmp_path: Path) -> None:
    header = read_header(write_numpy(str(tmp_path / "e.safetensors"), {"e": np.zeros((3, 0), np.float16)}))
    assert header.data_size == 0
    assert header.tensors[0].begin == header.tensors[0].end == 0
    nothing = read_header(broken(tmp_path, {}))
    assert nothing.tensors == ()
    assert nothing.metadata == {}
    assert nothing.data_size == 0


def test_metadata(tmp_path: Path) -> None:
    metadata = {"format": "pt", "note": "é 🦀 \x00 line\nbreak", "": "empty key", "json": '{"a": [1]}'}
    path = write_numpy(str(tmp_path / "m.safetensors"), {"w": np.ones(3, np.float32)}, metadata=metadata)
    header = read_header(path)
    assert dict(header.metadata) == metadata
    check_against_file(header, path)


@pytest.mark.parametrize("dtype", sorted(RAW_DTYPES))
def test_raw_dtypes(tmp_path: Path, dtype: str) -> None:
    width = RAW_DTYPES[dtype][1]
    data = bytes(range(6 * width))
    path = write_raw(
        str(tmp_path / "raw.safetensors"),
        {"x": (dtype, [2, 3], data), "y": (dtype, [], bytes(width)), "z": (dtype, [0], b"")},
    )
    header = read_header(path)
    check_against_file(header, path)
    by_name = {t.name: t for t in header.tensors}
    assert by_name["x"].dtype == dtype
    assert by_name["x"].size == 6 * width
    assert tensor_bytes(path, "x") == data
    assert by_name["y"].shape == ()
    assert by_name["z"].size == 0


@pytest.mark.parametrize(
    ("dtype", "shape", "size"),
    [
        ("F4", [2], 1),
        ("F4", [2, 3], 3),
        ("F4", [0], 0),
        ("F4", [], None),
        ("F6_E2M3", [4], 3),
        ("F6_E3M2", [2, 4], 6),
        ("F6_E2M3", [4, 0, 3], 0),
        ("F8_E8M0", [5], 5),
    ],
)
def test_sub_byte_dtypes_with_whole_bytes(tmp_path: Path, dtype: str, shape: list[int], size: int | None) -> None:
    if size is None:  # a 0-rank F4 is 4 bits: never whole bytes
        refused(broken(tmp_path, {"w": tensor(dtype, shape, 0, 1)}, data=b"\0"), errors.MisalignedSlice, 8, "w")
        return
    header = read_header(broken(tmp_path, {"w": tensor(dtype, shape, 0, size)}, data=b"\x5a" * size))
    assert header.tensors[0].size == size
    assert header.tensors[0].dtype == dtype


def test_all_22_dtypes_in_one_file(tmp_path: Path) -> None:
    header_doc: dict[str, Any] = {}
    position = 0
    for dtype, bits in DTYPE_BITS.items():
        size = 8 * bits // 8  # 8 elements: whole bytes for every width
        header_doc[f"t.{dtype}"] = tensor(dtype, [2, 4], position, position + size)
        position += size
    header = read_header(broken(tmp_path, header_doc, data=b"\1" * position))
    assert len(DTYPE_BITS) == 22
    assert {t.dtype for t in header.tensors} == set(DTYPE_BITS)
    assert header.data_size == position


def test_zero_size_tensors_share_an_offset(tmp_path: Path) -> None:
    header_doc = {
        "z1": tensor("U8", [0], 0, 0),
        "a": tensor("F32", [1], 0, 4),
        "z2": tensor("F32", [0, 5], 4, 4),
        "z3": tensor("BF16", [3, 0], 4, 4),
        "b": tensor("U8", [2], 4, 6),
        "z4": tensor("I64", [0], 6, 6),
        "z5": tensor("I64", [0], 0, 0),
    }
    header = read_header(broken(tmp_path, header_doc, data=b"\0" * 6))
    assert [t.name for t in header.tensors] == list(header_doc)
    assert [t.size for t in header.tensors] == [0, 4, 0, 0, 2, 0, 0]


def test_trailing_space_padding(tmp_path: Path) -> None:
    body = json.dumps({"w": tensor("U8", [3], 0, 3)}, separators=(",", ":")).encode()
    header = read_header(broken(tmp_path, raw=body + b" " * 5, data=b"abc"))
    assert header.json_at == (8, len(body))
    assert header.data_start == 8 + len(body) + 5
    assert header.tensors[0].name == "w"


def test_padding_of_files_the_reference_writes(tmp_path: Path) -> None:
    path = write_numpy(str(tmp_path / "m.safetensors"), {"w": np.ones(3, np.float32)}, metadata={"k": "v"})
    header = read_header(path)
    with open(path, "rb") as stream:
        raw = stream.read(header.data_start)[8:]
    assert header.data_start % 8 == 0  # the reference aligns the data section
    assert header.json_at == (8, len(raw.rstrip(b" ")))
    json_length = header.json_at[1]
    json.loads(raw[:json_length])
    assert raw[json_length:] == b" " * (len(raw) - json_length)


def test_other_whitespace_inside_and_after_json(tmp_path: Path) -> None:
    raw = b'{ "w" :\n\t{"dtype": "U8", "shape": [ 1 ], "data_offsets": [0,1]}\r\n}\n\t'
    header = read_header(broken(tmp_path, raw=raw, data=b"x"))
    assert header.tensors[0].name == "w"
    assert header.json_at == (8, len(raw))  # only spaces count as padding


def test_odd_names_are_kept_exactly(tmp_path: Path) -> None:
    names = ["", ".", "..", "a..b", "a/b", "%2F", "a\x00b", "é", "e\u0301", "\u202e", "🦀", "a.b", "a.b.c", "x" * 300]
    header_doc = {name: tensor("U8", [1], i, i + 1) for i, name in enumerate(names)}
    header = read_header(broken(tmp_path, header_doc, data=bytes(len(names))))
    assert [t.name for t in header.tensors] == names


def test_digest_tells_headers_apart(tmp_path: Path) -> None:
    one = read_header(write_header(str(tmp_path / "1"), {"w": tensor("U8", [1], 0, 1)}, data=b"x"))
    two = read_header(write_header(str(tmp_path / "2"), {"v": tensor("U8", [1], 0, 1)}, data=b"x"))
    same = read_header(write_header(str(tmp_path / "3"), {"w": tensor("U8", [1], 0, 1)}, data=b"y"))
    assert one.digest != two.digest
    assert one.digest == same.digest


def test_mtime_is_the_files(tmp_path: Path) -> None:
    path = broken(tmp_path, {})
    os.utime(path, ns=(1_500_000_000_123_456_789, 1_600_000_000_987_654_321))
    assert read_header(path).mtime_ns == 1_600_000_000_987_654_321


# -- hostile headers: a clean error, quickly --------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_deeply_nested_json(tmp_path: Path, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    depth = 100_000
    raw = b'{"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + opener * depth + b"1" * (opener != b"[")
    raw += closer * depth + b"}}"
    exc = refused(broken(tmp_path, raw=raw), errors.RecursionLimitExceeded, 5, "w")
    assert "deep" in exc.message


@pytest.mark.timeout(30)
def test_deeply_nested_metadata_value(tmp_path: Path) -> None:
    raw = b'{"__metadata__":{"k":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    exc = refused(broken(tmp_path, raw=raw), errors.RecursionLimitExceeded, 5)
    assert "__metadata__" in exc.message


@pytest.mark.timeout(60)
def test_header_of_100_million_bytes(tmp_path: Path) -> None:
    prefix = b'{"__metadata__":{"x":"'
    suffix = b'"},"w":' + json.dumps(tensor("U8", [2], 0, 2)).encode() + b"}"
    body = prefix + b"a" * (MAX_HEADER_LENGTH - len(prefix) - len(suffix)) + suffix
    assert len(body) == MAX_HEADER_LENGTH
    path = broken(tmp_path, raw=body, data=b"ab")
    header = read_header(path)  # at the limit: valid
    assert len(header.metadata["x"]) > 99_000_000
    with open(path, "ab") as stream:
        stream.write(b"!")
    refused(path, errors.MetadataIncompleteBuffer, 11, "w")


@pytest.mark.timeout(30)
def test_shape_with_a_billion_elements(tmp_path: Path) -> None:
    refused(broken(tmp_path, {"w": tensor("F32", [10**9], 0, 4)}, data=b"\0" * 4), errors.TensorInvalidInfo, 9, "w")
    refused(
        broken(tmp_path, {"w": tensor("F32", [10**9] * 3, 0, 4)}, data=b"\0" * 4), errors.ValidationOverflow, 8, "w"
    )


@pytest.mark.timeout(30)
def test_shape_of_millions_of_ones(tmp_path: Path) -> None:
    ones = [1] * 2_000_000
    header = read_header(broken(tmp_path, {"w": tensor("F32", ones, 0, 4)}, data=b"\0" * 4))
    assert len(header.tensors[0].shape) == 2_000_000
    assert header.tensors[0].parameters == 1
    exc = refused(broken(tmp_path, {"w": tensor("F32", ones, 0, 8)}, data=b"\0" * 8), errors.TensorInvalidInfo, 9, "w")
    assert "..." in exc.message  # the shape is shortened, not printed whole


@pytest.mark.timeout(30)
def test_huge_integer_literals(tmp_path: Path) -> None:
    digits = b"9" * 1_000_000
    raw = b'{"w":{"dtype":"U8","shape":[' + digits + b'],"data_offsets":[0,1]}}'
    refused(broken(tmp_path, raw=raw, data=b"x"), errors.NumberOutOfRange, 5, "w")
    raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + digits + b"}}"
    exc = refused(broken(tmp_path, raw=raw, data=b"x"), errors.NumberOutOfRange, 5, "w")
    assert "1000000 characters" in exc.message
    raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":0.' + b"0" * 1_000_000 + b"1e-5}}"
    assert read_header(broken(tmp_path, raw=raw, data=b"x")).tensors[0].size == 1
    raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1e' + digits + b"}}"
    refused(broken(tmp_path, raw=raw, data=b"x"), errors.NumberOutOfRange, 5, "w")
    raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1e-' + digits + b"}}"
    assert read_header(broken(tmp_path, raw=raw, data=b"x")).tensors[0].size == 1


@pytest.mark.timeout(30)
def test_many_tensors(tmp_path: Path) -> None:
    count = 50_000
    header_doc = {f"t{i}": tensor("U8", [1], i, i + 1) for i in range(count)}
    header = read_header(broken(tmp_path, header_doc, data=b"\0" * count))
    assert len(header.tensors) == count
    header_doc[f"t{count - 1}"] = tensor("U8", [1], count, count + 1)
    refused(broken(tmp_path, header_doc, data=b"\0" * (count + 1)), errors.InvalidOffset, 10, f"t{count - 1}")
