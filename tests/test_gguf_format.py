"""The GGUF reader (stfs/formats/gguf/): files gguf-py writes read as gguf-py reads them; one hand-made broken file
per rule of llama.cpp's reader (SPEC §11); the valid edge cases; split sets; header.json; reads that grow."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from stfs import errors
from stfs.formats import gguf
from stfs.formats.gguf import rules as gguf_rules
from tests.helpers import short_fuzz_run

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent

# -- writing files -----------------------------------------------------------------------------------------------


def write(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]], **keys: Any) -> Path:
    """A GGUF that GGUFWriter writes: ``tensors`` name -> (array, raw_dtype); ``keys`` (dots as ``__``) -> value,
    typed by gguf-py's rules (int i32, float f32, bool, str, list array), or a (value, GGUFValueType) pair."""
    writer = GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        key = key.replace("__", ".")
        if isinstance(value, tuple):
            writer.add_key_value(key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None)
        elif key == "general.alignment":
            writer.add_custom_alignment(value)
        else:
            writer.add_key_value(key, value, GGUFValueType.get_type(value))
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(kind: GGMLQuantizationType, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of ``blocks`` blocks of random bytes, as GGUFWriter takes a quantized tensor."""
    _, type_size = GGML_QUANT_SIZES[kind]
    return np.random.default_rng(seed).integers(0, 256, size=(rows, blocks * type_size), dtype=np.uint8)


class Counting:
    """A range reader over a file's bytes that counts requests and bytes and remembers the furthest byte asked."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.requests = 0
        self.bytes = 0
        self.furthest = 0

    def __call__(self, offset: int, size: int) -> bytes:
        assert size > 0 and offset >= 0
        self.requests += 1
        self.bytes += size
        self.furthest = max(self.furthest, offset + size)
        return self.data[offset : offset + size]


def read(path: Path | str, data: bytes | None = None) -> gguf.GgufHeader:
    data = Path(path).read_bytes() if data is None else data
    return gguf.read_header(Counting(data), len(data), path=str(path))


# -- against gguf-py's reader ------------------------------------------------------------------------------------


def same_as_gguf_py(path: Path) -> gguf.GgufHeader:
    """Read ``path`` with both readers; every tensor and key/value must agree."""
    header = read(path)
    reference = GGUFReader(str(path))
    assert header.data_offset == reference.data_offset
    assert header.alignment == reference.alignment
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    data = path.read_bytes()
    for ours, theirs in zip(header.tensors, reference.tensors, strict=True):
        assert ours.dtype == theirs.tensor_type.name
        assert ours.type.id == int(theirs.tensor_type)
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.elements == theirs.n_elements
        assert ours.file_offset == theirs.data_offset
        assert ours.nbytes == theirs.n_bytes
        assert data[ours.file_offset : ours.file_offset + ours.nbytes] == theirs.data.tobytes()
        if ours.type.numpy_dtype is not None:
            assert ours.shape == theirs.data.shape  # C order: GGUF's dimensions reversed
            assert np.dtype(ours.type.numpy_dtype) == theirs.data.dtype
    theirs_keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    assert list(header.metadata) == theirs_keys
    for key in theirs_keys:
        field, kv = reference.fields[key], header.metadata[key]
        assert kv.type == field.types[0]
        if kv.item_type is not None:
            assert kv.item_type == field.types[1]
        value = field.contents()
        if isinstance(kv.value, np.ndarray):
            assert kv.value.tolist() == value
        else:
            assert kv.value == value, key
    return header


def test_every_key_type_and_several_tensor_types_read_as_gguf_py_reads_them(tmp_path: Path) -> None:
    q8 = quants.quantize(
        np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32), GGMLQuantizationType.Q8_0
    )
    path = write(
        tmp_path / "m.gguf",
        {
            "token_embd.weight": (np.arange(24, dtype=np.float32).reshape(2, 3, 4), None),
            "blk.0.attn_norm.weight": (np.ones(7, dtype=np.float16), None),
            "blk.0.attn_q.weight": (q8, GGMLQuantizationType.Q8_0),
            "blk.0.ffn_up.weight": (random_blocks(GGMLQuantizationType.Q4_K, 2, 3), GGMLQuantizationType.Q4_K),
            "blk.0.ffn_down.weight": (random_blocks(GGMLQuantizationType.IQ2_XXS, 1, 1), GGMLQuantizationType.IQ2_XXS),
            "ids": (np.arange(5, dtype=np.int64), None),
            "f64": (np.linspace(0, 1, 9).reshape(3, 3), None),
        },
        a__u8=(255, GGUFValueType.UINT8),
        a__i8=(-128, GGUFValueType.INT8),
        a__u16=(65535, GGUFValueType.UINT16),
        a__i16=(-32768, GGUFValueType.INT16),
        a__u32=(2**32 - 1, GGUFValueType.UINT32),
        a__i32=-(2**31),
        a__f32=1e-5,
        a__bool=True,
        a__str="héllo wörld",
        a__u64=(2**64 - 1, GGUFValueType.UINT64),
        a__i64=(-(2**63), GGUFValueType.INT64),
        a__f64=(0.1, GGUFValueType.FLOAT64),
        a__strs=["a", "", "Ġthe", "日本"],
        a__ints=[1, 2, 3],
        a__floats=[0.5, 1e-5, -2.0],
        a__bools=[True, False, True],
        a__u64s=([2**64 - 1, 0], GGUFValueType.ARRAY, GGUFValueType.UINT64),
        a__f64s=([0.1, 1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    )
    header = same_as_gguf_py(path)
    assert header.version == 3 and header.alignment == 32
    assert header.metadata["a.u64"].value == 2**64 - 1 and header.metadata["a.i64"].value == -(2**63)
    assert header.metadata["a.bool"].value is True
    assert header.metadata["a.strs"].value == ["a", "", "Ġthe", "日本"]
    assert header.metadata["a.u64s"].value.tolist() == [2**64 - 1, 0]
    q = {t.name: t for t in header.tensors}
    assert q["blk.0.ffn_up.weight"].shape == (2, 768) and q["blk.0.ffn_up.weight"].nbytes == 2 * 3 * 144
    assert q["blk.0.attn_q.weight"].shape == (3, 64)


def test_every_type_gguf_knows_reads_back_its_bytes(tmp_path: Path) -> None:
    kinds = [t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES]
    blocks = {f"t.{kind.name}": (random_blocks(kind, 2, 3, seed=int(kind)), kind) for kind in kinds}
    path = write(tmp_path / "all.gguf", blocks)
    header = same_as_gguf_py(path)
    data = path.read_bytes()
    for tensor in header.tensors:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[tensor.dtype]]
        assert tensor.shape == (2, 3 * block_size)
        array, _ = blocks[tensor.name]
        assert data[tensor.file_offset : tensor.file_offset + tensor.nbytes] == array.tobytes()
        assert tensor.file_offset % 32 == 0


def test_quantized_bytes_decode_as_the_package_quantized_them(tmp_path: Path) -> None:
    values = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    tensors = {}
    for kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0):
        tensors[kind.name] = (quants.quantize(values, kind), kind)
    header = read(write(tmp_path / "q.gguf", tensors))
    data = (tmp_path / "q.gguf").read_bytes()
    for tensor in header.tensors:
        stored = np.frombuffer(data, np.uint8, tensor.nbytes, tensor.file_offset).reshape(tensor.shape[0], -1)
        decoded = quants.dequantize(stored, GGMLQuantizationType[tensor.dtype])
        assert decoded.shape == tensor.shape
        np.testing.assert_array_equal(decoded, quants.dequantize(tensors[tensor.dtype][0], tensor.type.id))


@pytest.mark.parametrize("alignment", [1, 2, 8, 64, 4096])
def test_any_power_of_two_alignment(tmp_path: Path, alignment: int) -> None:
    path = write(
        tmp_path / "a.gguf",
        {"x": (np.ones(3, np.float32), None), "y": (np.ones(5, np.int8), None), "z": (np.ones(2, np.float16), None)},
        general__alignment=alignment,
    )
    header = same_as_gguf_py(path)
    assert header.alignment == alignment
    assert all(t.file_offset % alignment == 0 for t in header.tensors)


def test_trailing_bytes_and_a_zero_length_dimension_are_accepted(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.gguf", {"empty": (np.zeros((0, 4), np.float32), None), "x": (np.ones(4, np.float32), None)}
    )
    with open(path, "ab") as stream:
        stream.write(b"\x01" * 1000)
    header = same_as_gguf_py(path)
    empty = header.tensors[0]
    assert empty.shape == (0, 4) and empty.nbytes == 0 and empty.elements == 0
    assert header.tensors[1].offset == 0  # a zero-byte tensor takes no padded room


def test_no_tensors_the_data_section_starts_where_the_infos_end(tmp_path: Path) -> None:
    data = build([kv_str("general.architecture", "llama")], [])
    header = read("x.gguf", data)
    assert header.tensors == () and header.data_offset == header.header_size == len(data)


# -- hand-made files ---------------------------------------------------------------------------------------------


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def i32(value: int) -> bytes:
    return struct.pack("<i", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def i64(value: int) -> bytes:
    return struct.pack("<q", value)


def string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw) if length is None else length) + raw


def kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return string(key) + i32(kind) + payload


def kv_str(key: str, value: str) -> bytes:
    return kv(key, GGUFValueType.STRING, string(value))


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, GGUFValueType.UINT32, u32(value))


def kv_array(key: str, item: int, count: int, payload: bytes) -> bytes:
    return kv(key, GGUFValueType.ARRAY, i32(item) + u64(count) + payload)


def info(name: str | bytes, dims: Sequence[int], kind: int, offset: int) -> bytes:
    return string(name) + u32(len(dims)) + b"".join(i64(d) for d in dims) + i32(kind) + u64(offset)


def build(
    kvs: Sequence[bytes],
    infos: Sequence[bytes],
    data: bytes = b"",
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    head = magic + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    if infos:
        head += bytes(-len(head) % alignment)
    return head + data


F32 = int(GGMLQuantizationType.F32)
Q4_K = int(GGMLQuantizationType.Q4_K)
ARCH = kv_str("general.architecture", "llama")


def two_tensors(**overrides: Any) -> bytes:
    """A valid file: t0 F32 (2, 4) at 0, t1 F32 (3,) at 32; ``overrides`` go to ``build``."""
    infos = overrides.pop("infos", [info("t0", [4, 2], F32, 0), info("t1", [3], F32, 32)])
    kvs = overrides.pop("kvs", [ARCH])
    data = overrides.pop("data", bytes(32) + bytes(12))
    return build(kvs, infos, data, **overrides)


def test_the_hand_made_file_is_valid_for_both_readers(tmp_path: Path) -> None:
    path = tmp_path / "hand.gguf"
    path.write_bytes(two_tensors())
    header = same_as_gguf_py(path)
    assert [(t.name, t.shape, t.offset, t.nbytes) for t in header.tensors] == [
        ("t0", (2, 4), 0, 32),
        ("t1", (3,), 32, 12),
    ]


def refused(data: bytes, error: type[gguf_rules.GgufError], tensor: str | None = None) -> str:
    """``data`` must be refused with exactly ``error``: one line naming the file, the tensor and the rule."""
    path = "/models/broken.gguf"
    with pytest.raises(gguf_rules.GgufError) as caught:
        gguf.read_header(Counting(data), len(data), path=path)
    exc = caught.value
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, errors.FormatError) and isinstance(exc, errors.StfsError)
    message = exc.message
    assert message.startswith(f"{path}: "), message
    assert f": stfs cannot mount this GGUF file, by its rule '{error.rule_text}' ({error.__name__}); " in message
    assert "\n" not in message and len(message) < 500, message
    assert exc.tensor == tensor
    if tensor is not None:
        assert f"tensor {tensor!r}" in message
    return message


def test_magic() -> None:
    assert "b'GGUX'" in refused(two_tensors(magic=b"GGUX"), gguf_rules.InvalidMagic)


def test_too_short_for_the_magic() -> None:
    refused(b"GGU", gguf_rules.GgufTruncated)


def test_version_0() -> None:
    refused(two_tensors(version=0), gguf_rules.UnsupportedVersion)


def test_version_1_is_obsolete() -> None:
    assert "obsolete" in refused(two_tensors(version=1), gguf_rules.ObsoleteVersion)


def test_version_4() -> None:
    assert "4" in refused(two_tensors(version=4), gguf_rules.UnsupportedVersion)


@pytest.mark.parametrize("version", [2, 3])
def test_big_endian_file(version: int) -> None:
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    message = refused(two_tensors(version=swapped), gguf_rules.BigEndianFile)
    assert "big-endian" in message and f"version {version}" in message


def test_version_2_is_read() -> None:
    assert read("v2.gguf", two_tensors(version=2)).version == 2


def test_tensor_count_negative_as_i64() -> None:
    refused(two_tensors(n_tensors=2**63), gguf_rules.InvalidCount)


def test_kv_count_negative_as_i64() -> None:
    refused(two_tensors(n_kv=2**64 - 1), gguf_rules.InvalidCount)


def test_kv_count_more_than_the_bytes_left_hold() -> None:
    refused(two_tensors(n_kv=10**9), gguf_rules.InvalidCount)


def test_tensor_count_more_than_the_bytes_left_hold() -> None:
    refused(two_tensors(n_tensors=10**12), gguf_rules.InvalidCount)


def test_key_longer_than_1_gib() -> None:
    assert "1 GiB" in refused(two_tensors(kvs=[string("k", 2**30 + 1)]), gguf_rules.StringTooLong)


def test_key_longer_than_the_bytes_left() -> None:
    refused(two_tensors(kvs=[string("k", 10**6) + b"k"]), gguf_rules.StringTooLong)


def test_string_value_longer_than_the_bytes_left() -> None:
    refused(two_tensors(kvs=[kv("k", GGUFValueType.STRING, string("v", 10**6))]), gguf_rules.StringTooLong)


def test_empty_key() -> None:
    refused(two_tensors(kvs=[kv_str("", "x")]), gguf_rules.EmptyKey)


def test_duplicate_key() -> None:
    assert "'a.b'" in refused(two_tensors(kvs=[kv_u32("a.b", 1), kv_u32("a.b", 2)]), gguf_rules.DuplicateKvKey)


@pytest.mark.parametrize("kind", [13, 255, -1])
def test_kv_type_outside_0_to_12(kind: int) -> None:
    refused(two_tensors(kvs=[kv("k", kind, u32(0))]), gguf_rules.InvalidKvType)


def test_array_of_arrays() -> None:
    nested = kv_array("k", GGUFValueType.ARRAY, 1, i32(GGUFValueType.UINT8) + u64(1) + b"\x01")
    assert "array of arrays" in refused(two_tensors(kvs=[nested]), gguf_rules.InvalidKvType)


def test_array_of_an_unknown_type() -> None:
    refused(two_tensors(kvs=[kv_array("k", 13, 1, b"\x00")]), gguf_rules.InvalidKvType)


def test_array_over_2_to_the_30_elements() -> None:
    assert "2^30" in refused(
        two_tensors(kvs=[kv_array("k", GGUFValueType.UINT8, 2**30 + 1, b"")]), gguf_rules.ArrayTooLong
    )


def test_array_larger_than_the_bytes_left() -> None:
    refused(two_tensors(kvs=[kv_array("k", GGUFValueType.UINT64, 10**6, b"")]), gguf_rules.ArrayTooLong)


def test_string_array_whose_lengths_alone_pass_the_end() -> None:
    refused(two_tensors(kvs=[kv_array("k", GGUFValueType.STRING, 10**6, b"")]), gguf_rules.ArrayTooLong)


def test_string_array_element_longer_than_1_gib() -> None:
    strings = string("a") + string("b", 2**30 + 5)
    message = refused(two_tensors(kvs=[kv_array("k", GGUFValueType.STRING, 2, strings)]), gguf_rules.StringTooLong)
    assert "element 1" in message


def test_string_array_element_past_the_end() -> None:
    strings = string("a") + string("b", 5000)
    refused(build([kv_array("k", GGUFValueType.STRING, 2, strings)], []), gguf_rules.StringTooLong)


@pytest.mark.parametrize(
    "entry",
    [
        kv("general.alignment", GGUFValueType.UINT64, u64(32)),
        kv("general.alignment", GGUFValueType.INT32, i32(32)),
        kv_array("general.alignment", GGUFValueType.UINT32, 1, u32(32)),
    ],
    ids=["u64", "i32", "array"],
)
def test_alignment_not_a_u32(entry: bytes) -> None:
    refused(two_tensors(kvs=[entry]), gguf_rules.InvalidAlignment)


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**32 - 1])
def test_alignment_not_a_power_of_two(alignment: int) -> None:
    refused(two_tensors(kvs=[kv_u32("general.alignment", alignment)]), gguf_rules.InvalidAlignment)


def test_tensor_name_of_64_bytes() -> None:
    name = "n" * 64
    assert "64" in refused(
        two_tensors(infos=[info(name, [4], F32, 0)], data=bytes(16)), gguf_rules.TensorNameTooLong, name
    )


def test_tensor_name_of_63_bytes_is_fine() -> None:
    name = "n" * 63
    assert read("x.gguf", two_tensors(infos=[info(name, [4], F32, 0)], data=bytes(16))).tensors[0].name == name


def test_tensor_name_longer_than_the_bytes_left() -> None:
    refused(two_tensors(infos=[string("t", 10**6)]), gguf_rules.StringTooLong)


def test_duplicate_tensor_name() -> None:
    infos = [info("t0", [4], F32, 0), info("t0", [4], F32, 32)]
    refused(two_tensors(infos=infos, data=bytes(48)), gguf_rules.DuplicateTensorName, "t0")


def test_tensor_names_equal_up_to_a_nul_are_duplicates_as_llama_cpp_compares_them() -> None:
    infos = [info(b"t\x00a", [4], F32, 0), info(b"t\x00b", [4], F32, 32)]
    refused(two_tensors(infos=infos, data=bytes(48)), gguf_rules.DuplicateTensorName, "t\x00b")


def test_more_than_4_dimensions() -> None:
    refused(two_tensors(infos=[info("t0", [1, 1, 1, 1, 1], F32, 0)], data=bytes(4)), gguf_rules.InvalidDimensions, "t0")


def test_negative_dimension() -> None:
    assert "-3" in refused(two_tensors(infos=[info("t0", [4, -3], F32, 0)]), gguf_rules.InvalidDimensions, "t0")


def test_element_count_overflow() -> None:
    refused(two_tensors(infos=[info("t0", [2**32, 2**31], F32, 0)]), gguf_rules.GgufOverflow, "t0")


@pytest.mark.parametrize("kind", [4, 5, 31, 36, 42, 43, 1000, -1])
def test_type_gguf_does_not_know(kind: int) -> None:
    assert f"type {kind}" in refused(two_tensors(infos=[info("t0", [4], kind, 0)]), gguf_rules.UnknownGgmlType, "t0")


def test_first_dimension_not_a_multiple_of_the_block() -> None:
    message = refused(two_tensors(infos=[info("t0", [100, 2], Q4_K, 0)]), gguf_rules.RowNotBlockMultiple, "t0")
    assert "Q4_K" in message and "256" in message


def test_byte_size_overflow() -> None:
    f64 = int(GGMLQuantizationType.F64)
    refused(two_tensors(infos=[info("t0", [2**61, 2], f64, 0)]), gguf_rules.GgufOverflow, "t0")


def test_data_section_size_overflow() -> None:
    f64 = int(GGMLQuantizationType.F64)
    infos = [info("t0", [2**59, 2], f64, 0), info("t1", [2**59, 2], f64, 2**63)]
    refused(two_tensors(infos=infos), gguf_rules.GgufOverflow, "t1")


def test_padded_data_start_past_the_end() -> None:
    data = build([ARCH], [info("t0", [0], F32, 0)], alignment=1)  # no padding after the infos
    assert len(data) % 32
    read("x.gguf", data + bytes(-len(data) % 32))  # with its padding, the zero-byte tensor is fine
    refused(data, gguf_rules.DataSectionOutOfFile)


@pytest.mark.parametrize(
    "offsets",
    [(32, 64), (0, 64), (0, 0), (0, 16)],
    ids=["first-not-at-0", "gap", "overlap", "unpadded"],
)
def test_offsets_not_the_running_sum_of_padded_sizes(offsets: tuple[int, int]) -> None:
    infos = [info("t0", [4, 2], F32, offsets[0]), info("t1", [3], F32, offsets[1])]
    bad = "t0" if offsets[0] else "t1"
    refused(two_tensors(infos=infos, data=bytes(128)), gguf_rules.TensorOffsetMismatch, bad)


def test_reordered_offsets() -> None:
    infos = [info("t0", [4, 2], F32, 32), info("t1", [3], F32, 0)]
    refused(two_tensors(infos=infos, data=bytes(64)), gguf_rules.TensorOffsetMismatch, "t0")


def test_tensor_past_the_end_of_the_file() -> None:
    refused(two_tensors(data=bytes(32 + 11)), gguf_rules.TensorOutOfFile, "t1")


def test_last_tensor_ending_at_the_end_without_padding_is_fine() -> None:
    header = read("x.gguf", two_tensors(data=bytes(32 + 12)))
    assert header.tensors[-1].file_offset + header.tensors[-1].nbytes == header.file_size


@pytest.mark.parametrize("cut", [5, 12, 20])
def test_file_ending_inside_a_fixed_size_field(cut: int) -> None:
    refused(two_tensors()[:cut], gguf_rules.GgufTruncated)


def test_file_ending_inside_a_tensor_info() -> None:
    data = two_tensors()
    end = data.index(b"t1") + 2 + 6  # inside t1's dimension count
    refused(data[:end], gguf_rules.GgufTruncated)


def test_negative_first_dimension_is_seen_before_a_truncated_second() -> None:
    data = build([ARCH], [info("t0", [-1, 4], F32, 0)])
    cut = data.index(i64(-1)) + 8 + 3
    refused(data[:cut], gguf_rules.InvalidDimensions, "t0")


# -- edge cases that llama.cpp accepts ---------------------------------------------------------------------------


def test_a_tensor_with_no_dimensions_is_refused() -> None:
    # llama.cpp refuses only n_dims > 4 (n_dims 0 is one element to it); SPEC §11 asks for 1 to 4 dimensions.
    message = refused(build([ARCH], [info("s", [], F32, 0)], struct.pack("<f", 2.5)), gguf_rules.InvalidDimensions, "s")
    assert "0 dimensions" in message


def test_bool_byte_other_than_1_is_true() -> None:
    header = read("x.gguf", build([kv("b", GGUFValueType.BOOL, b"\x02"), kv("c", GGUFValueType.BOOL, b"\x00")], []))
    assert header.metadata["b"].value is True and header.metadata["c"].value is False
    assert gguf.value_json(header.metadata["b"]) == "true"


def test_names_and_strings_that_are_not_utf8_keep_their_bytes() -> None:
    entries = [
        kv("k\xff".encode("latin-1"), GGUFValueType.STRING, string(b"v\xfe\xc3")),
        kv_array("a", GGUFValueType.STRING, 2, string(b"ok") + string(b"\xff")),
    ]
    header = read("x.gguf", build(entries, [info(b"t\xff", [1], F32, 0)]) + bytes(4))
    assert os.fsencode(header.tensors[0].name) == b"t\xff"
    kv_, array = header.metadata.values()
    assert os.fsencode(kv_.key) == b"k\xff"
    assert gguf.metadata_file(kv_) == b"v\xfe\xc3\n"  # a string's file: its bytes as stored
    assert gguf.metadata_file(array) == b'["ok","\\udcff"]\n'  # JSON: the escape of the surrogate
    assert json.loads(gguf.metadata_file(array)) == ["ok", "\udcff"]
    text = gguf.header_json(header)
    document = json.loads(text)
    assert set(document) == {"__metadata__", "t\udcff"}


# -- header.json and metadata/ -----------------------------------------------------------------------------------


def test_header_json_in_the_safetensors_schema(tmp_path: Path) -> None:
    path = write(
        tmp_path / "h.gguf",
        {
            "token_embd.weight": (np.ones((3, 8), np.float32), None),
            "blk.0.ffn_up.weight": (random_blocks(GGMLQuantizationType.Q4_K, 2, 1), GGMLQuantizationType.Q4_K),
        },
        llama__context_length=4096,
        llama__rope__freq_base=10000.0,
        llama__attention__layer_norm_rms_epsilon=1e-5,
        tokenizer__ggml__tokens=["<s>", "a", "b"],
        general__flag=False,
    )
    header = read(path)
    text = gguf.header_json(header)
    document = json.loads(text)
    assert list(document) == ["__metadata__", "token_embd.weight", "blk.0.ffn_up.weight"]
    assert document["token_embd.weight"] == {"dtype": "F32", "shape": [3, 8], "data_offsets": [0, 96]}
    assert document["blk.0.ffn_up.weight"] == {"dtype": "Q4_K", "shape": [2, 256], "data_offsets": [96, 96 + 288]}
    meta = document["__metadata__"]
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == 4096
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "a", "b"]
    assert meta["general.flag"] is False
    assert b'"llama.attention.layer_norm_rms_epsilon":1e-05' in text
    assert b'"llama.rope.freq_base":10000.0' in text
    for tensor in header.tensors:  # data_offsets are relative to the data section
        begin, end = document[tensor.name]["data_offsets"]
        assert header.data_offset + begin == tensor.file_offset and end - begin == tensor.nbytes


def test_metadata_files() -> None:
    entries = [
        kv_str("general.name", "Llama 3 8B"),
        kv("a.f32", GGUFValueType.FLOAT32, struct.pack("<f", 1e-5)),
        kv("a.f64", GGUFValueType.FLOAT64, struct.pack("<d", 1e-5)),
        kv("a.u64", GGUFValueType.UINT64, u64(2**64 - 1)),
        kv("a.bool", GGUFValueType.BOOL, b"\x01"),
        kv_array("a.strs", GGUFValueType.STRING, 2, string("x") + string('q"é')),
        kv_array("a.i16", GGUFValueType.INT16, 3, struct.pack("<3h", -1, 0, 7)),
        kv_array("a.f32s", GGUFValueType.FLOAT32, 2, struct.pack("<2f", 0.1, 3.0)),
    ]
    header = read("x.gguf", build(entries, []))
    files = {key: gguf.metadata_file(kv_) for key, kv_ in header.metadata.items()}
    assert files == {
        "general.name": b"Llama 3 8B\n",
        "a.f32": b"1e-05\n",
        "a.f64": b"1e-05\n",
        "a.u64": b"18446744073709551615\n",
        "a.bool": b"true\n",
        "a.strs": '["x","q\\"é"]\n'.encode(),
        "a.i16": b"[-1,0,7]\n",
        "a.f32s": b"[0.1,3.0]\n",
    }


def test_float32_values_are_the_shortest_decimal_that_reads_back() -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, size=50_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    values = np.concatenate([values, np.float32([1e-5, 0.1, -0.0, 0.0, 1e20, 3.4028235e38, 1e-45, 16777217.0])])
    entry = kv_array("f", GGUFValueType.FLOAT32, len(values), values.astype("<f4").tobytes())
    texts = json.loads("[" + gguf.value_json(read("x.gguf", build([entry], [])).metadata["f"])[1:-1] + "]")
    raw = gguf.value_json(read("x.gguf", build([entry], [])).metadata["f"])[1:-1].split(",")
    assert np.array_equal(np.float32(texts), values)  # reads back as the same float32
    assert raw[-8:-4] == ["1e-05", "0.1", "-0.0", "0.0"]
    for text, value in zip(raw, values, strict=True):
        # as short as numpy's shortest-for-float32 (Dragon4, the reference the SPEC names)
        assert significant_digits(text) == significant_digits(np.format_float_scientific(value, unique=True))


def significant_digits(text: str) -> int:
    mantissa = text.lower().split("e")[0].lstrip("-").replace(".", "").lstrip("0").rstrip("0")
    return max(1, len(mantissa))


def test_non_finite_floats_are_json_strings() -> None:
    values = struct.pack("<3f", float("nan"), float("inf"), float("-inf"))
    entries = [
        kv_array("f", GGUFValueType.FLOAT32, 3, values),
        kv("d", GGUFValueType.FLOAT64, struct.pack("<d", float("-inf"))),
    ]
    header = read("x.gguf", build(entries, []))
    assert gguf.value_json(header.metadata["f"]) == '["NaN","Infinity","-Infinity"]'
    assert gguf.metadata_file(header.metadata["d"]) == b'"-Infinity"\n'
    json.loads(gguf.header_json(header))


def test_string_arrays_decode_as_one_by_one_whatever_their_bytes() -> None:
    rng = np.random.default_rng(4)
    pool = [b"", b"\xff", b"a\xffb", b"\xc3", b"\xc3\xa9", b"\xe2\x82", b"\xf0\x9f\x98\x80", b"\xed\xa0\x80", b"\x00"]
    for trial in range(40):
        items = [b"".join(rng.choice(pool, size=int(rng.integers(0, 4)))) for _ in range(int(rng.integers(1, 30)))]
        if trial % 2:
            items = [i.replace(b"\xff", b"") for i in items]  # the one-call path
        entry = kv_array("s", GGUFValueType.STRING, len(items), b"".join(string(i) for i in items))
        got = read("x.gguf", build([entry], [])).metadata["s"].value
        assert got == [i.decode("utf-8", "surrogateescape") for i in items]


def test_a_vocabulary_s_json_is_json_s_whatever_its_strings() -> None:
    """A string array is walked and made JSON over its bytes (stfs.formats.gguf._walk, _string_array): the same
    values and text as json.dumps of the strings one by one, across stretches, long strings and every escape."""
    rng = np.random.default_rng(5)
    pool = [bytes([b]) for b in range(0x80)] + [b"\xc3\xa9", b"\xe2\x80\xa8", b"\xf0\x9f\x98\x80", b"a" * 300, b""]
    plain = [
        b"tok" + bytes(rng.integers(97, 123, size=int(rng.integers(0, 12)), dtype=np.uint8)) for _ in range(300_000)
    ]
    cases = {
        "escapes": [b"".join(rng.choice(pool, size=int(rng.integers(0, 5)))) for _ in range(20_000)],
        "long strings": [b"x" * int(rng.integers(250, 2000)) for _ in range(5_000)],  # lengths of 256 and more
        "empty strings": [b""] * 5_000,
        "over 4 MiB of plain ones": plain,
        "not UTF-8": [b"ok", b"\xc3", b'"'],
    }
    for name, items in cases.items():
        entry = kv_array("s", GGUFValueType.STRING, len(items), b"".join(string(i) for i in items))
        header = read("x.gguf", build([entry, kv_u32("after", 7)], []))
        expected = [i.decode("utf-8", "surrogateescape") for i in items]
        kv_ = header.metadata["s"]
        assert kv_.value == expected and len(kv_.value) == len(expected), name
        assert gguf.value_json(kv_) == json.dumps(expected, ensure_ascii=False, separators=(",", ":")), name
        assert header.metadata["after"].value == 7


def test_whole_numbers_are_written_as_json_and_numpy_write_them() -> None:
    rng = np.random.default_rng(6)
    kinds = {
        GGUFValueType.UINT8: "<u1",
        GGUFValueType.INT8: "<i1",
        GGUFValueType.UINT16: "<u2",
        GGUFValueType.INT16: "<i2",
        GGUFValueType.UINT32: "<u4",
        GGUFValueType.INT32: "<i4",
        GGUFValueType.UINT64: "<u8",
        GGUFValueType.INT64: "<i8",
    }
    for kind, dtype in kinds.items():
        limits = np.iinfo(dtype)
        edges = np.array([limits.min, limits.max, 0, 1, 9, 10, 99, 100], dtype=dtype)
        values = np.concatenate([edges, rng.integers(limits.min, limits.max, size=3000, dtype=dtype, endpoint=True)])
        entry = kv_array("n", kind, len(values), values.tobytes())
        text = gguf.value_json(read("x.gguf", build([entry], [])).metadata["n"])
        assert text == json.dumps(values.tolist(), separators=(",", ":")), dtype
    scores = np.concatenate([np.float32([-0.0, 0.0, 999_999, -999_999, 120_000]), -np.arange(151_936, dtype="<f4")])
    entry = kv_array("f", GGUFValueType.FLOAT32, len(scores), scores.tobytes())
    text = gguf.value_json(read("x.gguf", build([entry], [])).metadata["f"])
    assert text == "[" + ",".join(scores.astype(str).tolist()) + "]"  # -0.0, 999999.0: numpy's shortest


# -- split sets --------------------------------------------------------------------------------------------------


def write_split_set(folder: Path, count_tensors: int = 5, per_split: int = 2) -> list[Path]:
    """A gguf-split set written by GGUFWriter: ``count_tensors`` tensors, ``per_split`` a split."""
    folder.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(folder / "model.gguf"), "llama", split_max_tensors=per_split)
    writer.add_uint32("llama.context_length", 4096)
    for i in range(count_tensors):
        writer.add_tensor(f"blk.{i}.w", np.full((2, 4), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob("model-*-of-*.gguf"))


def test_split_set_written_by_gguf_writer(tmp_path: Path) -> None:
    paths = write_split_set(tmp_path)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    name, files = gguf.split_set_names(paths[1].name) or ("", [])
    assert name == "model" and files == [p.name for p in paths]
    model = gguf.merge_splits(name, files, [same_as_gguf_py(p) for p in paths])
    assert [t.name for _, t in model.tensors] == [f"blk.{i}.w" for i in range(5)]
    assert [f for f, _ in model.tensors] == [files[0], files[0], files[1], files[1], files[2]]
    assert model.metadata["llama.context_length"].value == 4096
    assert model.metadata["split.no"].value == 0
    document = json.loads(gguf.header_json(model))
    assert document["blk.2.w"] == {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32], "file": files[1]}
    assert document["__metadata__"]["split.count"] == 3 and document["__metadata__"]["split.tensors.count"] == 5


def test_split_names() -> None:
    assert gguf.split_set_names("x-00002-of-00002.gguf") == ("x", ["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"])
    assert gguf.split_set_names("a-b-00001-of-00001.gguf") == ("a-b", ["a-b-00001-of-00001.gguf"])
    for name in ("x.gguf", "x-00003-of-00002.gguf", "x-00000-of-00002.gguf", "x-1-of-2.gguf", "x-00001-of-00002.bin"):
        assert gguf.split_set_names(name) is None


def test_split_missing(tmp_path: Path) -> None:
    paths = write_split_set(tmp_path)
    headers = [read(p) for p in paths]
    with pytest.raises(gguf_rules.MissingSplit, match="model-00002-of-00003.gguf"):
        gguf.merge_splits("model", [p.name for p in paths], [headers[0], None, headers[2]])


def test_split_out_of_place(tmp_path: Path) -> None:
    paths = write_split_set(tmp_path)
    headers = [read(p) for p in paths]
    with pytest.raises(gguf_rules.SplitOutOfPlace, match="split.no is 2, but it is split 1"):
        gguf.merge_splits("model", [p.name for p in paths], [headers[0], headers[2], headers[1]])


def hand_split(no: int, count: int, total: int, names: Sequence[str], **extra: bytes) -> gguf.GgufHeader:
    kvs = [
        kv("split.no", GGUFValueType.UINT16, struct.pack("<H", no)),
        kv("split.count", GGUFValueType.UINT16, struct.pack("<H", count)),
        kv("split.tensors.count", GGUFValueType.INT32, i32(total)),
        *extra.values(),
    ]
    infos = [info(name, [4], F32, 32 * i) for i, name in enumerate(names)]
    return read(f"s-{no + 1:05d}-of-{count:05d}.gguf", build(kvs, infos, bytes(32 * len(names))))


def test_split_tensor_in_two_splits() -> None:
    headers = [hand_split(0, 2, 3, ["a", "b"]), hand_split(1, 2, 3, ["b"])]
    with pytest.raises(gguf_rules.DuplicateSplitTensor, match="'b'"):
        gguf.merge_splits("s", ["s-00001-of-00002.gguf", "s-00002-of-00002.gguf"], headers)


def test_split_tensor_count_disagrees() -> None:
    headers = [hand_split(0, 2, 4, ["a", "b"]), hand_split(1, 2, 4, ["c"])]
    with pytest.raises(gguf_rules.SplitTensorCount, match="split.tensors.count is 4, but the 2 splits hold 3"):
        gguf.merge_splits("s", ["s-00001-of-00002.gguf", "s-00002-of-00002.gguf"], headers)


def test_split_count_disagrees_with_the_names() -> None:
    headers = [hand_split(0, 3, 2, ["a"]), hand_split(1, 3, 2, ["b"])]
    with pytest.raises(gguf_rules.SplitOutOfPlace, match="split.count is 3"):
        gguf.merge_splits("s", ["s-00001-of-00002.gguf", "s-00002-of-00002.gguf"], headers)


def test_split_key_missing_or_of_another_type() -> None:
    plain = read("s-00001-of-00001.gguf", build([ARCH], []))
    with pytest.raises(gguf_rules.SplitOutOfPlace, match="'split.no' of a split is missing"):
        gguf.merge_splits("s", ["s-00001-of-00001.gguf"], [plain])
    wrong = read("s-00001-of-00001.gguf", build([kv_u32("split.no", 0)], []))
    with pytest.raises(gguf_rules.SplitOutOfPlace, match="u32, not u16"):
        gguf.merge_splits("s", ["s-00001-of-00001.gguf"], [wrong])


# -- the type helper for the views -------------------------------------------------------------------------------


def test_ggml_types_are_the_packages() -> None:
    assert {t.name for t in gguf.GGML_TYPES.values()} == {t.name for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}
    q4k = gguf.ggml_type("Q4_K")
    assert (q4k.id, q4k.block_size, q4k.type_size, q4k.numpy_dtype) == (12, 256, 144, None)
    assert gguf.ggml_type(0).numpy_dtype == "<f4" and gguf.ggml_type("I16").numpy_dtype == "<i2"
    with pytest.raises(KeyError):
        gguf.ggml_type(4)
    with pytest.raises(KeyError):
        gguf.ggml_type("Q2_0")


@pytest.mark.parametrize("kind", [t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES], ids=lambda t: t.name)
def test_dequantizable_says_what_the_package_decodes(kind: GGMLQuantizationType) -> None:
    ours = gguf.ggml_type(kind.name)
    block = random_blocks(kind, 2, 2, seed=5)
    try:
        values = quants.dequantize(block, kind)
    except NotImplementedError:
        assert not ours.dequantizable
        return
    assert ours.dequantizable
    assert values.dtype == np.float32 and values.shape == (2, 2 * ours.block_size)


def test_dequantizable_as_the_formats_notes_list_it() -> None:
    undecodable = {t.name for t in gguf.GGML_TYPES.values() if not t.dequantizable}
    assert undecodable == {"Q8_1", "Q8_K", "Q1_0", "I8", "I16", "I32", "I64", "F64"}


# -- reads that grow ---------------------------------------------------------------------------------------------


def vocabulary_file(path: Path, tokens: int, token_length: int, data_bytes: int = 4 * MIB) -> Path:
    lengths = np.random.default_rng(tokens).integers(1, token_length, size=tokens)
    letters = "abcdefghijklmnopqrstuvwxyz" * (token_length // 26 + 2)
    vocabulary = [letters[i % 26 : i % 26 + int(n)] for i, n in enumerate(lengths)]
    writer = GGUFWriter(str(path), "llama")
    writer.add_token_list(vocabulary)
    writer.add_token_scores([float(i) for i in range(tokens)])
    writer.add_token_types([1] * tokens)
    writer.add_tensor("w", np.ones(data_bytes // 4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("tokens", "token_length"),
    [(10, 8), (90_000, 20), (20_000, 220), (40_000, 330), (50_000, 600), (60_000, 960)],
    ids=["tiny", "2.2MiB-short-tokens", "2.4MiB", "6.9MiB", "15MiB", "28MiB"],
)
def test_remote_header_costs_at_most_4_requests_and_twice_its_bytes_plus_2_mib(
    tmp_path: Path, tokens: int, token_length: int
) -> None:
    path = vocabulary_file(tmp_path / "v.gguf", tokens, token_length, data_bytes=64 * MIB)
    data = path.read_bytes()
    reader = Counting(data)
    header = gguf.read_header(reader, len(data), path=str(path))
    size = header.data_offset
    assert size < 30 * MIB
    assert reader.requests <= 4, (reader.requests, size)
    assert reader.bytes <= 2 * size + 2 * MIB, (reader.bytes, size)
    assert reader.furthest == reader.bytes  # each byte asked once
    assert header.tensors[0].nbytes == 64 * MIB and reader.furthest < header.tensors[0].file_offset + 64 * MIB


def test_a_prefix_that_ends_inside_the_header_asks_for_more() -> None:
    entry = kv_array("s", GGUFValueType.STRING, 3, string("aaaa") + string("bbbb") + string("cccc"))
    data = build([ARCH, entry], [info("t", [4], F32, 0)], bytes(16))
    whole = gguf.parse_header(data, file_size=len(data), path="x.gguf")
    for cut in range(whole.header_size):
        with pytest.raises(gguf.HeaderIncomplete) as caught:
            gguf.parse_header(data[:cut], file_size=len(data), path="x.gguf")
        assert cut < caught.value.need <= whole.header_size  # a lower bound on the header, past what it had
    assert gguf.parse_header(data[: whole.header_size], file_size=len(data), path="x.gguf").tensors == whole.tensors


def test_a_file_shorter_than_its_size_said_is_truncated() -> None:
    data = two_tensors()
    with pytest.raises(
        gguf_rules.GgufTruncated, match=f"ended after {len(data)} bytes, short of the {len(data) + 1000}"
    ):
        gguf.read_header(lambda offset, size: data[offset : offset + size], len(data) + 1000, path="x.gguf")


# -- the fuzzer, briefly -----------------------------------------------------------------------------------------


def test_fuzzer_finds_nothing_in_a_short_run(tmp_path: Path) -> None:
    assert "refusals: " in short_fuzz_run("fuzz_gguf.py", tmp_path, 6, 7)
