"""Decoding to float32 and ``.npy`` headers, without a mount: every float dtype against a reference decoding
(``ml_dtypes``'s own casts; an independent bit-level decoder for F4 and F6), reads at any offset and size,
chunks, NaN codes, subnormals, rounding."""

from __future__ import annotations

import io
import random
import struct

import numpy as np
import pytest

from stfs import nodes
from stfs.decode import CODECS, F32, NATIVE, npy_header, table
from stfs.formats.dtypes import DTYPE_BITS
from stfs.nodes import Decoded, FileNode, read_into
from tests.decoding import every_code, minifloat_reference, parse_npy_header, reference


class Source:
    """A source of one file held in memory; records each read."""

    def __init__(self, data: bytes, at: int = 0) -> None:
        self.data = b"\x00" * at + data
        self.reads: list[tuple[int, int]] = []

    def read_into(self, key: str, offset: int, view: memoryview, span: tuple[int, int] | None = None) -> int:
        chunk = self.data[offset : offset + len(view)]
        view[: len(chunk)] = chunk
        self.reads.append((offset, len(chunk)))
        return len(chunk)


def decoded(dtype: str, data: bytes, at: int = 0) -> Decoded:
    return Decoded("src", at, len(data) * 8 // DTYPE_BITS[dtype] * 4, CODECS[dtype])


def test_every_float_dtype_but_f32_has_a_codec() -> None:
    floats = {dtype for dtype in DTYPE_BITS if dtype.startswith(("F", "BF"))}
    assert set(CODECS) == floats - {"F32"}
    assert not set(CODECS) & (set(NATIVE) - {"F16", "F64"})


@pytest.mark.parametrize("dtype", sorted(CODECS))
def test_whole_decode_equals_the_reference(dtype: str) -> None:
    data = every_code(dtype, 4096)
    segment = decoded(dtype, data, at=77)
    out = bytearray(segment.size)
    segment.read_into(0, memoryview(out), Source(data, at=77).read_into)
    expected = reference(data, dtype)
    got = np.frombuffer(bytes(out), dtype=F32)
    np.testing.assert_array_equal(got, expected)  # NaN where NaN, -0.0 == 0.0: signs checked below
    assert np.array_equal(np.signbit(got), np.signbit(expected))


@pytest.mark.parametrize("dtype", sorted(CODECS))
def test_reads_anywhere_decode_only_the_source_bytes_that_cover_them(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nodes, "CHUNK_BYTES", 4096)  # many chunks in one read
    data = every_code(dtype, 12_000, seed=1)
    expected = reference(data, dtype).tobytes()
    segment = decoded(dtype, data, at=5)
    codec = segment.codec
    rng = random.Random(dtype)
    for _ in range(150):
        start = rng.randrange(0, segment.size)
        length = min(rng.choice([1, 3, 4, 17, 4096, 5000, 20_000, 48_000]), segment.size - start)
        source = Source(data, at=5)
        out = bytearray(length)
        segment.read_into(start, memoryview(out), source.read_into)
        assert bytes(out) == expected[start : start + length], (start, length)
        first = start // codec.group_out * codec.group_bytes + 5
        last = -(-(start + length) // codec.group_out) * codec.group_bytes + 5
        assert source.reads[0][0] == first and sum(size for _, size in source.reads) == last - first
        assert max(size for _, size in source.reads) * codec.group_out // codec.group_bytes <= 4096 + codec.group_out


def test_a_file_of_header_and_decoded_values_reads_across_the_boundary() -> None:
    data = every_code("BF16", 3000)
    header = npy_header(F32, (3000,))
    node = FileNode(1, 0, (header, decoded("BF16", data)))
    expected = header + reference(data, "BF16").tobytes()
    assert node.size == len(expected)
    source = Source(data)
    for offset in range(len(header) - 9, len(header) + 9):
        for size in (1, 2, 5, 13, 4096):
            view = memoryview(bytearray(size))
            count = read_into(node, offset, view, source.read_into)
            assert bytes(view[:count]) == expected[offset : offset + size]


def test_a_short_source_is_an_error() -> None:
    data = every_code("F8_E4M3", 1000)
    segment = decoded("F8_E4M3", data)
    with pytest.raises(OSError, match="short read"):
        segment.read_into(0, memoryview(bytearray(segment.size)), Source(data[:500]).read_into)


NAN_CODES = {
    "BF16": [0x7FC0, 0xFFC1, 0x7F81],
    "F16": [0x7E00, 0xFC01],
    "F8_E4M3": [0x7F, 0xFF],
    "F8_E5M2": [0x7D, 0xFE, 0xFF],
    "F8_E4M3FNUZ": [0x80],
    "F8_E5M2FNUZ": [0x80],
    "F8_E8M0": [0xFF],
}
# the smallest positive subnormal code of each dtype, and its value
SUBNORMALS = {
    "BF16": (0x0001, 2.0**-133),
    "F16": (0x0001, 2.0**-24),
    "F8_E4M3": (0x01, 2.0**-9),
    "F8_E5M2": (0x01, 2.0**-16),
    "F8_E4M3FNUZ": (0x01, 2.0**-10),
    "F8_E5M2FNUZ": (0x01, 2.0**-17),
    "F8_E8M0": (0x00, 2.0**-127),  # no subnormals of its own, but 2^-127 is one in float32
    "F4": (0x1, 0.5),
    "F6_E2M3": (0x1, 0.125),
    "F6_E3M2": (0x1, 0.0625),
}


def decode_codes(dtype: str, codes: list[int]) -> np.ndarray:
    width = DTYPE_BITS[dtype]
    if width >= 8:
        data = b"".join(code.to_bytes(width // 8, "little") for code in codes)
    else:  # pack little-endian, as the views read it
        stream = sum(code << (width * k) for k, code in enumerate(codes))
        data = stream.to_bytes(len(codes) * width // 8, "little")
    segment = decoded(dtype, data)
    out = bytearray(segment.size)
    segment.read_into(0, memoryview(out), Source(data).read_into)
    return np.frombuffer(bytes(out), dtype=F32)


@pytest.mark.parametrize("dtype", sorted(NAN_CODES))
def test_nan_codes_give_nan(dtype: str) -> None:
    assert np.isnan(decode_codes(dtype, NAN_CODES[dtype])).all()


@pytest.mark.parametrize("dtype", sorted(SUBNORMALS))
def test_subnormals_are_kept(dtype: str) -> None:
    code, value = SUBNORMALS[dtype]
    width = DTYPE_BITS[dtype]
    codes = [code, 0, 0, code | 1 << (width - 1)] if dtype != "F8_E8M0" else [code, 0x7F, code, 0x7F]
    got = decode_codes(dtype, codes)
    assert got[0] == np.float32(value) and got[0] != 0
    if dtype != "F8_E8M0":
        assert got[3] == -np.float32(value)


def test_f4_packs_the_low_nibble_first_and_f6_a_little_endian_bit_stream() -> None:
    assert list(decode_codes("F4", [0x2, 0xF])) == [1.0, -6.0]  # the byte 0xF2
    assert list(decode_codes("F4", [0x2, 0xF])) == list(reference(b"\xf2", "F4"))
    # E2M3: 1.0 is 0b001000, -7.5 is 0b111111; four values in 3 bytes
    assert list(decode_codes("F6_E2M3", [0b001000, 0b111111, 0, 0b001000])) == [1.0, -7.5, 0.0, 1.0]
    stream = 0b001000 | 0b111111 << 6 | 0b001000 << 18
    assert list(reference(stream.to_bytes(3, "little"), "F6_E2M3")) == [1.0, -7.5, 0.0, 1.0]


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_ml_dtypes_tables_match_the_bit_level_definition(dtype: str) -> None:
    width = DTYPE_BITS[dtype]
    codes = list(range(1 << width))
    stream = sum(code << (width * k) for k, code in enumerate(codes))
    expected = minifloat_reference(stream.to_bytes(len(codes) * width // 8, "little"), dtype)
    np.testing.assert_array_equal(table(dtype), expected)
    assert np.array_equal(np.signbit(table(dtype)), np.signbit(expected))


def test_f64_rounds_to_nearest_even_and_overflows_to_infinity() -> None:
    values = [1e39, -1e39, 1 + 2.0**-24, 1 + 3 * 2.0**-24, 2.0**-149, 2.0**-151, float("nan")]
    got = decode_codes("F64", [struct.unpack("<Q", struct.pack("<d", value))[0] for value in values])
    assert got[0] == np.inf and got[1] == -np.inf
    assert got[2] == 1.0 and got[3] == np.float32(1 + 2.0**-22)  # ties to even
    assert got[4] == np.float32(2.0**-149) and got[5] == 0.0 and np.isnan(got[6])


SHAPES = [(), (0,), (0, 4), (3,), (2, 3, 4), (1,) * 30, (70000, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", sorted(NATIVE))
def test_npy_header_is_what_np_save_writes(dtype: str, shape: tuple[int, ...]) -> None:
    stream = io.BytesIO()
    np.save(stream, np.zeros(shape, dtype=NATIVE[dtype]))
    header = npy_header(NATIVE[dtype], shape)
    assert stream.getvalue()[: len(header)] == header
    assert len(stream.getvalue()) == len(header) + int(np.prod(shape)) * NATIVE[dtype].itemsize


def test_npy_header_passes_64_kib_in_format_2() -> None:
    shape = (1,) * 30_000  # a header of ~90 KB
    version, fields, start = parse_npy_header(npy_header(F32, shape))
    assert version == (2, 0) and fields == {"descr": "<f4", "fortran_order": False, "shape": shape}
    assert start % 64 == 0
    version, fields, start = parse_npy_header(npy_header(F32, (5, 7)))
    assert version == (1, 0) and fields["shape"] == (5, 7) and start == 128
