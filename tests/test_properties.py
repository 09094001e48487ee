"""Property tests: whatever bytes a file or an index holds, stfs answers with a Header/Model or an StfsError."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stfs import errors
from stfs.formats.safetensors import DTYPE_BITS, Header
from stfs.info import render_json, render_table, summarize
from stfs.model import Model, read_header, resolve
from stfs.views import merged_header
from tests.models import sharded_arrays, write_header, write_numpy, write_sharded

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Every code point, with surrogates (json.dumps escapes them as \udXXX) and separators made likely.
ANY_CHAR = (
    st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=())
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    | st.sampled_from('.\x00/%\\"é\u0301🦀')
)
ODD_TEXT = st.text(ANY_CHAR, max_size=12) | st.sampled_from(["", ".", "..", "a..b", "/", "\x00", "\ud800", "é", "🦀"])
HUGE_INTS = st.sampled_from([-1, -(2**63), 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 2**128, 10**30, 10**400])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | HUGE_INTS
    | st.floats(allow_nan=False, allow_infinity=False)
    | ODD_TEXT
    | st.sampled_from(list(DTYPE_BITS))
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(ODD_TEXT, inner, max_size=5),
    max_leaves=20,
)


def valid_header() -> dict[str, Any]:
    return {
        "__metadata__": {"format": "pt", "k": "v"},
        "a.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "a.bias": {"dtype": "BF16", "shape": [3], "data_offsets": [24, 30]},
        "b": {"dtype": "F4", "shape": [4], "data_offsets": [30, 32]},
        "c": {"dtype": "U8", "shape": [0], "data_offsets": [32, 32]},
        "d": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [32, 35]},
    }


DATA_SIZE = 35


def check_header(header: Header) -> None:
    """What a Header promises whenever read_header returns one."""
    position = 0
    for entry in sorted(header.tensors, key=lambda e: (e.begin, e.end)):
        assert entry.begin == position
        assert entry.size * 8 == entry.parameters * DTYPE_BITS[entry.dtype]
        position = entry.end
    assert position == header.data_size
    for text in [*(t.name for t in header.tensors), *header.metadata, *header.metadata.values()]:
        text.encode("utf-8")  # every name can become a file name and JSON output


def check_model(model: Model) -> None:
    for shard in model.shards:
        check_header(shard.header)
    json.loads(merged_header(model))
    report = summarize([model])
    json.loads(render_json(report))
    render_table(report).encode("utf-8")


def read(path: str) -> Header | None:
    try:
        header = read_header(path)
    except errors.StfsError as exc:
        assert exc.message and "\n" not in exc.message
        if isinstance(exc, errors.FormatError):
            assert 1 <= exc.rule <= 11
            assert exc.message.startswith(path)
        return None
    check_header(header)
    return header


def resolve_all(source: str) -> list[Model] | None:
    try:
        models = resolve(source)
    except errors.StfsError as exc:
        assert exc.message
        return None
    for model in models:
        check_model(model)
    return models


# -- random files ---------------------------------------------------------------------------------------------------


@SETTINGS
@given(content=st.binary(max_size=300))
def test_random_bytes(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    read(str(path))
    resolve_all(str(path))


@SETTINGS
@given(body=st.binary(max_size=200), data=st.binary(max_size=40), slack=st.integers(-3, 3))
def test_random_header_bytes_with_a_plausible_length(tmp_path: Path, body: bytes, data: bytes, slack: int) -> None:
    path = str(tmp_path / "x.safetensors")
    write_header(path, None, raw=b"{" + body, data=data, length=max(0, len(body) + 1 + slack))
    read(path)


# -- mutations of a valid file ----------------------------------------------------------------------------------------


def valid_bytes(tmp_path: Path) -> bytes:
    path = write_header(str(tmp_path / "valid.safetensors"), valid_header(), data=bytes(range(DATA_SIZE)))
    assert read(path) is not None
    return Path(path).read_bytes()


@SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_byte_flips(tmp_path: Path, flips: list[tuple[int, int]]) -> None:
    content = bytearray(valid_bytes(tmp_path))
    for position, mask in flips:
        content[position % len(content)] ^= mask
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(content))
    read(str(path))


@SETTINGS
@given(cut=st.integers(0, 10**6))
def test_truncation(tmp_path: Path, cut: int) -> None:
    content = valid_bytes(tmp_path)
    cut %= len(content)
    path = tmp_path / "x.safetensors"
    path.write_bytes(content[:cut])
    assert read(str(path)) is None  # a valid file less any byte is never valid


def set_at(document: dict[str, Any], route: list[Any], value: Any) -> None:
    target: Any = document
    for step in route[:-1]:
        target = target[step]
    target[route[-1]] = value


ROUTES = [
    ["__metadata__"],
    ["__metadata__", "k"],
    ["__metadata__", "new"],
    ["a.weight"],
    ["a.weight", "dtype"],
    ["a.weight", "shape"],
    ["a.weight", "shape", 0],
    ["a.weight", "data_offsets"],
    ["a.weight", "data_offsets", 1],
    ["a.bias", "data_offsets", 0],
    ["b", "shape", 0],
    ["c", "shape"],
    ["d", "dtype"],
    ["d", "extra"],
    ["new.tensor"],
]


@SETTINGS
@given(
    edits=st.lists(st.tuples(st.sampled_from(ROUTES), JSON_VALUES), min_size=1, max_size=3),
    ascii_only=st.booleans(),
    padding=st.integers(0, 9),
    data_delta=st.integers(-2, 2),
)
def test_json_value_replacement(
    tmp_path: Path, edits: list[tuple[list[Any], Any]], ascii_only: bool, padding: int, data_delta: int
) -> None:
    document = valid_header()
    for route, value in edits:
        with contextlib.suppress(TypeError, IndexError, KeyError):  # an earlier edit replaced the container
            set_at(document, route, value)
    try:
        body = json.dumps(document, ensure_ascii=ascii_only).encode("utf-8")
    except UnicodeEncodeError:  # a raw surrogate: write it as the bytes a broken writer would
        body = json.dumps(document, ensure_ascii=False).encode("utf-8", "surrogatepass")
    path = str(tmp_path / "x.safetensors")
    write_header(path, None, raw=body + b" " * padding, data=b"\0" * max(0, DATA_SIZE + data_delta))
    header = read(path)
    if header is not None:
        assert header.json_at == (8, len(body))
    resolve_all(path)


@SETTINGS
@given(depth=st.integers(1, 200_000), route=st.sampled_from(ROUTES), opener=st.sampled_from(["[", '{"k":']))
def test_deep_nesting_anywhere(tmp_path: Path, depth: int, route: list[Any], opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    marker = "MARKER-7f3a"
    document = valid_header()
    try:
        set_at(document, route, marker)
    except (TypeError, IndexError, KeyError):
        return
    nested = opener * depth + ("0" if opener != "[" else "") + closer * depth
    body = json.dumps(document).replace(json.dumps(marker), nested).encode()
    path = str(tmp_path / "x.safetensors")
    write_header(path, None, raw=body, data=b"\0" * DATA_SIZE)
    read(path)


@SETTINGS
@given(name=st.text(ANY_CHAR, max_size=6), meta=st.text(ANY_CHAR, max_size=6), ascii_only=st.booleans())
def test_any_name_is_a_valid_name_or_a_clean_error(tmp_path: Path, name: str, meta: str, ascii_only: bool) -> None:
    document = {"__metadata__": {meta: meta}, name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    body = json.dumps(document, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    path = str(tmp_path / "x.safetensors")
    write_header(path, None, raw=body, data=b"x")
    header = read(path)
    if ascii_only:  # "\\ud800\\udc00" escapes decode to one character, U+10000
        name, meta = json.loads(json.dumps(name)), json.loads(json.dumps(meta))
    has_surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in name + meta)
    assert (header is None) == has_surrogate
    if header is not None:
        assert [t.name for t in header.tensors] == [name]
        assert dict(header.metadata) == {meta: meta}


# -- sharded sets ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("set")
    write_sharded(str(folder), sharded_arrays())
    write_numpy(str(folder / "other.safetensors"), {"z": np.ones(2, np.float32)})
    return folder


INDEX_VALUES = JSON_VALUES | st.sampled_from(
    [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "other.safetensors",
        "missing.safetensors",
        "../model-00001-of-00002.safetensors",
        "/etc/passwd",
        "model.safetensors.index.json",
        ".",
        "",
    ]
)


@SETTINGS
@given(
    weight_map=st.dictionaries(
        st.sampled_from(["model.embed_tokens.weight", "lm_head.weight", "z", "ghost"]) | ODD_TEXT,
        INDEX_VALUES,
        max_size=6,
    ),
    extra=st.dictionaries(st.sampled_from(["metadata", "weight_map", "x"]), JSON_VALUES, max_size=2),
    raw=st.none() | st.binary(max_size=60),
)
def test_random_index(shard_folder: Path, weight_map: dict[str, Any], extra: dict[str, Any], raw: bytes | None) -> None:
    index = shard_folder / "model.safetensors.index.json"
    if raw is not None:
        index.write_bytes(raw)
    else:
        document = {"weight_map": weight_map, **extra}
        index.write_bytes(json.dumps(document).encode("utf-8", "surrogatepass"))
    resolve_all(str(index))
    resolve_all(str(shard_folder))


@SETTINGS
@given(content=st.binary(max_size=120))
def test_random_shard(tmp_path: Path, content: bytes) -> None:
    folder = tmp_path / "set"
    if not folder.exists():
        write_sharded(str(folder), sharded_arrays())
    shard = folder / "model-00002-of-00002.safetensors"
    original = shard.read_bytes()
    try:
        shard.write_bytes(content)
        models = resolve_all(str(folder / "model.safetensors.index.json"))
        if models is not None:
            assert len(models) == 1
    finally:
        shard.write_bytes(original)
    assert os.path.getsize(shard) == len(original)
