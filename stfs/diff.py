"""``stfs diff A B``: two models compared tensor by tensor, matched by name wherever each is stored (SPEC §10).

Each side is a SOURCE opened as ``stfs info`` opens one (a file, an index, a folder, a URL), its models resolved
by ``model``; a folder of several models names each tensor ``MODEL/NAME`` (MODEL as the mount's folder for it).
Tensors in both with the same dtype and shape are read once each, chunk by chunk (``scan.Reader``), in the order A
stores them, and compared by bytes first: equal chunks are equal values, and only the pieces whose bytes differ
are decoded (``values``). ‖a‖₂ needs the values of every piece once a tensor differs: those of the equal bytes
before its first difference are read again from a local side (its page cache), for that tensor only; with two
remote sides, the norm of every equal chunk is taken as it comes instead (decoding is faster than the network).

Where one side is a Hub repository, the Hub's listing gives each LFS file's sha256: the other side's file at the
same path with the same sha256 (a local file hashed by reading it) holds the same tensors, and none of its bytes
is fetched from the Hub.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import formats
from .chunks import CHUNK_BYTES, PIECE_VALUES
from .decode import to_float64
from .info import printable
from .model import Tensor, resolve
from .progress import ByteProgress, Progress
from .scan import REMOTE_CACHE, Reader, index_of, tensor_chunks
from .sources import ByteSource, Kind, named_source, open_source, parent_key, relative_key
from .sources.base import DEFAULT_TIMEOUT, is_url, shown_url
from .values import (
    Tally,
    add_norm,
    byte_count,
    compare_values,
    count_unequal_elements,
    same_bytes,
    value_count,
    values_known,
    values_per_chunk,
)

STATUSES = ("identical", "close", "different", "only_a", "only_b", "changed_type", "tied")
EQUAL = frozenset({"identical", "close", "tied"})


@dataclass(frozen=True, slots=True)
class Side:
    """One SOURCE, opened: its tensors by name, and the key its files' paths are taken relative to."""

    shown: str  # SOURCE as the report names it: a URL without its credentials
    source: ByteSource
    root: str  # its folder, or the folder of the file (or index) it names
    tensors: dict[str, Tensor]
    warnings: tuple[str, ...] = ()

    def relative(self, key: str) -> str:
        return relative_key(self.root, key)


def open_side(
    text: str, timeout: float = DEFAULT_TIMEOUT, progress: bool = False, cache_size: int = REMOTE_CACHE
) -> Side:
    """SOURCE ``text`` validated and resolved into its tensors (headers only), its source kept open for reading
    (``cache_size``: the block cache of a remote source); ``progress``: the line of headers read, where reading them
    takes a while."""
    text = named_source(text)
    source, key = open_source(text, timeout=timeout, keep_source_cache=True, cache_size=cache_size)
    try:
        models = resolve(key, source, Progress(enabled=progress))
        root = key if source.kind(key) is Kind.FOLDER else parent_key(key)
    except BaseException:
        source.close()
        raise
    several = len(models) > 1
    tensors = {(f"{model.name}/{t.name}" if several else t.name): t for model in models for t in model.tensors}
    warnings = tuple(warning for model in models for warning in model.warnings)
    return Side(shown_url(text) if is_url(text) else text, source, root, tensors, warnings)


@dataclass(frozen=True, slots=True)
class Result:
    """One tensor of either side, as the report lists it; ``compared``: its values (or its bytes) were compared, and
    ``differ``, ``max_abs``, ``where`` and ``rel_l2`` say what that found (``None`` where there is no such number)."""

    name: str
    status: str
    a: Tensor | None
    b: Tensor | None
    compared: bool = False
    differ: int | None = None
    max_abs: float | None = None
    where: list[int] | None = None
    rel_l2: float | None = None
    nonfinite: dict[str, int] | None = None  # values compared: the elements differing for a NaN or an inf, by kind
    tied_to: str | None = None  # status "tied": the tensor of both sides whose storage it shares in its side

    @property
    def equal(self) -> bool:
        return self.status in EQUAL


def _tallied(name: str, status: str, a: Tensor, b: Tensor, tally: Tally) -> Result:
    found = tally.where >= 0 and math.isfinite(tally.max_abs)
    return Result(
        name,
        status,
        a,
        b,
        compared=True,
        differ=tally.differ,
        max_abs=tally.max_abs if found else None,
        where=index_of(tally.where, a.shape) if found else None,
        rel_l2=tally.rel_l2,
        nonfinite=tally.nonfinite,
    )


@dataclass(frozen=True, slots=True)
class Report:
    """What ``stfs diff`` found: a result for every tensor of either side, by name."""

    a: str
    b: str
    results: tuple[Result, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for result in self.results:
            counts[result.status] += 1
        return counts

    @property
    def same(self) -> bool:
        """Every tensor in both, with the same dtype and shape and equal values: exit status 0."""
        return all(result.equal for result in self.results)


def diff(
    a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, timeout: float = DEFAULT_TIMEOUT, progress: bool = False
) -> Report:
    """Compare the models SOURCE ``a`` and SOURCE ``b`` names (``progress``: bars on stderr)."""
    cache_size = REMOTE_CACHE // max(1, sum(is_url(named_source(text)) for text in (a, b)))
    side_a = open_side(a, timeout, progress, cache_size)
    try:
        side_b = open_side(b, timeout, progress, cache_size)
        try:
            return compare_sides(side_a, side_b, atol=atol, rtol=rtol, progress=progress)
        finally:
            side_b.source.close()
    finally:
        side_a.source.close()


def compare_sides(a: Side, b: Side, *, atol: float = 0.0, rtol: float = 0.0, progress: bool = False) -> Report:
    """The report on two opened sides."""
    results = [Result(name, "only_a", t, None) for name, t in a.tensors.items() if name not in b.tensors]
    results += [Result(name, "only_b", None, t) for name, t in b.tensors.items() if name not in a.tensors]
    pairs = [(name, t, b.tensors[name]) for name, t in a.tensors.items() if name in b.tensors]
    same_files = known_same_files(a, b, progress)
    to_read = []
    for name, ta, tb in pairs:
        if (ta.file, tb.file) in same_files and (ta.offset, ta.size) == (tb.offset, tb.size):
            results.append(Result(name, "identical", ta, tb))
        else:
            to_read.append((name, ta, tb))
    to_read.sort(key=lambda pair: (pair[1].file, pair[1].offset))  # A in the order it is stored
    total = sum(ta.size + tb.size for _, ta, tb in to_read if _read(ta, tb))
    bar = ByteProgress(total, "comparing", progress)
    try:
        comparison = _Comparison(a, b, atol, rtol, bar)
        results += [comparison.compare(name, ta, tb) for name, ta, tb in to_read]
    finally:
        bar.close()
    ties = _ties(a, b), _ties(b, a)
    results = [_tied(result, ties) for result in results]
    results.sort(key=lambda result: result.name)
    return Report(a.shown, b.shown, tuple(results), a.warnings + b.warnings)


def _tied(result: Result, ties: tuple[dict[str, str], dict[str, str]]) -> Result:
    """``result`` as ``tied`` where it is a tensor of one side only that ``_ties`` found sharing a storage."""
    side = {"only_a": 0, "only_b": 1}.get(result.status)
    tied_to = None if side is None else ties[side].get(result.name)
    return result if tied_to is None else Result(result.name, "tied", result.a, result.b, tied_to=tied_to)


def _ties(own: Side, other: Side) -> dict[str, str]:
    """The tensors of ``own`` only that share their storage (one range: the same bytes of the same file, dtype and
    shape; a checkpoint's two names on one storage, as a tied ``lm_head.weight``'s) with a tensor ``other`` has too,
    each with the first such tensor by name: ``other`` left it out as ``save_pretrained`` leaves a tied weight out."""
    only = [name for name in own.tensors if name not in other.tensors]
    if not only:
        return {}
    in_both: dict[tuple[object, ...], str] = {}
    for name in sorted(name for name in own.tensors if name in other.tensors):
        in_both.setdefault(_storage(own.tensors[name]), name)
    found = {name: in_both.get(_storage(own.tensors[name])) for name in only if not own.tensors[name].scattered}
    return {name: tied_to for name, tied_to in found.items() if tied_to is not None}


def _storage(tensor: Tensor) -> tuple[object, ...]:
    """Where a tensor's bytes lie, as one range (a strided tensor's are gathered: never tied, its key its own)."""
    if tensor.scattered is not None:
        return (tensor.name,)
    return (tensor.file, tensor.offset, tensor.size, tensor.dtype, tensor.shape)


def _read(a: Tensor, b: Tensor) -> bool:
    """Whether comparing ``a`` and ``b`` reads them: the same shape, and the same dtype or two with values."""
    return a.shape == b.shape and (a.dtype == b.dtype or (values_known(a.dtype) and values_known(b.dtype)))


class _Comparison:
    """Compares tensor pairs, reading each side once through a reader of its own."""

    def __init__(self, a: Side, b: Side, atol: float, rtol: float, bar: ByteProgress) -> None:
        self.sides = (a, b)
        self.readers = (Reader(a.source, bar), Reader(b.source, bar))
        self.atol, self.rtol = atol, rtol
        self.out = (np.empty(PIECE_VALUES, dtype=np.float64), np.empty(PIECE_VALUES, dtype=np.float64))
        self._rereader: Reader | None = None
        # Without a local side, ‖a‖ of equal chunks is taken as they come: reading them again would fetch them again.
        self.norm_all = a.source.remote and b.source.remote

    def compare(self, name: str, a: Tensor, b: Tensor) -> Result:
        if not _read(a, b):
            return Result(name, "changed_type", a, b)
        if a.dtype != b.dtype:
            return _tallied(name, "changed_type", a, b, self._values_across_dtypes(a, b))
        if not values_known(a.dtype):
            same, differ = self._bytes(a, b)
            if same:
                return Result(name, "identical", a, b)
            return Result(name, "different", a, b, compared=True, differ=differ)
        tally = self._values(a, b)
        if tally is None:
            return Result(name, "identical", a, b)
        return _tallied(name, "close" if tally.differ == 0 else "different", a, b, tally)

    def _chunks(self, a: Tensor, b: Tensor, step_a: int, step_b: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return zip(tensor_chunks(self.readers[0], a, step_a), tensor_chunks(self.readers[1], b, step_b), strict=True)

    def _values(self, a: Tensor, b: Tensor) -> Tally | None:
        """Two tensors of one dtype compared chunk by chunk, bytes first; ``None`` if their bytes are the same."""
        dtype = a.dtype
        chunk_values = values_per_chunk(CHUNK_BYTES, dtype)
        step = byte_count(dtype, chunk_values)
        piece = byte_count(dtype, PIECE_VALUES)
        tally = Tally()
        differs = False
        equal_before = 0  # bytes before the first difference: ‖a‖ of them is taken at the end, if there is one
        for number, (raw_a, raw_b) in enumerate(self._chunks(a, b, step, step)):
            if same_bytes(raw_a, raw_b):
                if differs or self.norm_all:
                    self._norm(dtype, raw_a, tally)
                else:
                    equal_before += len(raw_a)
                continue
            differs = True
            for start in range(0, len(raw_a), piece):
                piece_a, piece_b = raw_a[start : start + piece], raw_b[start : start + piece]
                if same_bytes(piece_a, piece_b):
                    self._norm(dtype, piece_a, tally)
                    continue
                first = number * chunk_values + start // piece * PIECE_VALUES
                values_a = to_float64(dtype, piece_a, self.out[0])
                values_b = to_float64(dtype, piece_b, self.out[1])
                compare_values(values_a, values_b, first, self.atol, self.rtol, tally)
        if not differs:
            return None
        if equal_before and not self.norm_all:
            self._norm_again(a, b, equal_before, tally)
        return tally

    def _norm(self, dtype: str, raw: np.ndarray, tally: Tally) -> None:
        piece = byte_count(dtype, PIECE_VALUES)
        for start in range(0, len(raw), piece):
            add_norm(to_float64(dtype, raw[start : start + piece], self.out[0]), tally)

    def _norm_again(self, a: Tensor, b: Tensor, size: int, tally: Tally) -> None:
        """Add ‖a‖² of the first ``size`` bytes (equal on both sides), read again from a local side: the price of
        not decoding every equal chunk of every tensor in case a later one differs."""
        side, tensor = (1, b) if self.sides[0].source.remote else (0, a)
        if self._rereader is None or self._rereader.source is not self.sides[side].source:
            self._rereader = Reader(self.sides[side].source)
        step = byte_count(tensor.dtype, values_per_chunk(CHUNK_BYTES, tensor.dtype))  # whole groups (F6, GGML blocks)
        for raw in tensor_chunks(self._rereader, tensor, step, size):
            self._norm(tensor.dtype, raw, tally)

    def _values_across_dtypes(self, a: Tensor, b: Tensor) -> Tally:
        """Two tensors of one shape and two dtypes compared value by value (as float64)."""
        chunk_values = values_per_chunk(CHUNK_BYTES, a.dtype, b.dtype)
        tally = Tally()
        steps = byte_count(a.dtype, chunk_values), byte_count(b.dtype, chunk_values)
        for number, (raw_a, raw_b) in enumerate(self._chunks(a, b, *steps)):
            count = value_count(a.dtype, len(raw_a))
            for start in range(0, count, PIECE_VALUES):
                end = min(count, start + PIECE_VALUES)
                piece_a = raw_a[byte_count(a.dtype, start) : byte_count(a.dtype, end)]
                piece_b = raw_b[byte_count(b.dtype, start) : byte_count(b.dtype, end)]
                values_a = to_float64(a.dtype, piece_a, self.out[0])
                values_b = to_float64(b.dtype, piece_b, self.out[1])
                compare_values(values_a, values_b, number * chunk_values + start, self.atol, self.rtol, tally)
        return tally

    def _bytes(self, a: Tensor, b: Tensor) -> tuple[bool, int | None]:
        """Two tensors of one dtype without values (C64) compared by bytes: whether they are the same, and how many
        elements differ (``None`` for a dtype whose element size stfs does not know)."""
        element = formats.dtype(a.dtype).element_bytes
        step = CHUNK_BYTES // element * element if element else CHUNK_BYTES
        same, differ = True, 0
        for raw_a, raw_b in self._chunks(a, b, step, step):
            if not same_bytes(raw_a, raw_b):
                same = False
                differ += count_unequal_elements(raw_a, raw_b, element) if element else 0
        return same, differ if element else None


# -- the Hub's sha256 ----------------------------------------------------------------------------------------------


def known_same_files(a: Side, b: Side, progress: bool = False) -> set[tuple[str, str]]:
    """Pairs of files (A's key, B's key) at the same path below each SOURCE that hold the same bytes, known from the
    sha256 a side's listing gives (the Hub's) without reading it; the other side's file is hashed by reading it
    where it is local (or taken from its listing too). Files whose sizes differ are not hashed."""
    files_a = {a.relative(t.file): t.file for t in a.tensors.values()}
    files_b = {b.relative(t.file): t.file for t in b.tensors.values()}
    candidates = []
    for path in sorted(files_a.keys() & files_b.keys()):
        key_a, key_b = files_a[path], files_b[path]
        listed = a.source.listed_sha256(key_a), b.source.listed_sha256(key_b)
        if listed == (None, None) or a.source.stat(key_a).size != b.source.stat(key_b).size:
            continue
        sides = (a, b)
        if all(sha is not None or not side.source.remote for sha, side in zip(listed, sides, strict=True)):
            candidates.append((key_a, key_b, listed))
    to_hash = sum(a.source.stat(key_a).size for key_a, _, listed in candidates if listed[0] is None)
    to_hash += sum(b.source.stat(key_b).size for _, key_b, listed in candidates if listed[1] is None)
    bar = ByteProgress(to_hash, "sha256", progress)
    try:
        same = set()
        for key_a, key_b, listed in candidates:
            sha_a = listed[0] or _sha256(Reader(a.source, bar), key_a)
            sha_b = listed[1] or _sha256(Reader(b.source, bar), key_b)
            if sha_a == sha_b:
                same.add((key_a, key_b))
        return same
    finally:
        bar.close()


def _sha256(reader: Reader, key: str) -> str:
    digest = hashlib.sha256()
    for chunk in reader.chunks(key, 0, reader.source.stat(key).size):
        digest.update(chunk.data)
    return digest.hexdigest()


# -- the report ----------------------------------------------------------------------------------------------------


def _dtype_shape(tensor: Tensor) -> str:
    return f"{tensor.dtype} [{', '.join(str(d) for d in tensor.shape)}]"


def _number(value: float) -> str:
    return repr(value)


_NONFINITE_WORDS = {
    "nan_only_a": "NaN in A only",
    "nan_only_b": "NaN in B only",
    "inf_only_a": "inf in A only",
    "inf_only_b": "inf in B only",
    "inf_opposite": "+inf against -inf",
}


def _values_found(result: Result) -> str:
    assert result.a is not None and result.differ is not None
    text = f"{result.differ} of {result.a.parameters} values differ"
    kinds = [f"{n} {_NONFINITE_WORDS[kind]}" for kind, n in (result.nonfinite or {}).items() if n]
    if kinds:
        text += f" ({', '.join(kinds)})"
    if result.max_abs is not None:
        text += f", max |a-b| {_number(result.max_abs)} at {result.where}"
    if result.rel_l2 is not None:
        text += f", |a-b|/|a| {result.rel_l2:.3g}"
    return text


def line(result: Result) -> str | None:
    """The report's line for ``result`` (``None`` for a tensor equal in both)."""
    name = printable(result.name)
    a, b = result.a, result.b
    if result.status == "only_a" and a is not None:
        return f"- {name}  {_dtype_shape(a)}"
    if result.status == "only_b" and b is not None:
        return f"+ {name}  {_dtype_shape(b)}"
    if result.status == "tied" and result.tied_to is not None:
        tensor, side, other = (a, "A", "B") if a is not None else (b, "B", "A")
        assert tensor is not None
        tied_to = printable(result.tied_to)
        return f"= {name}  {_dtype_shape(tensor)}: tied in {side} to {tied_to} (one storage), which {other} has"
    if result.equal or a is None or b is None:
        return None
    if result.status == "changed_type":
        found = f": {_values_found(result)}" if result.compared else ""
        return f"! {name}  {_dtype_shape(a)} -> {_dtype_shape(b)}{found}"
    if result.differ is None:
        return f"~ {name}  {_dtype_shape(a)}: bytes differ"
    by_bytes = " (compared by bytes)" if not values_known(a.dtype) else ""
    return f"~ {name}  {_dtype_shape(a)}: {_values_found(result)}{by_bytes}"


def summary_line(report: Report) -> str:
    counts = report.counts
    tied = f", {counts['tied']} tied" if counts["tied"] else ""
    return (
        f"{len(report.results)} tensors: {counts['identical']} identical, {counts['close']} close, "
        f"{counts['different']} different, {counts['only_a']} only in A, {counts['only_b']} only in B, "
        f"{counts['changed_type']} with another dtype or shape{tied}"
    )


def render_text(report: Report) -> str:
    """A line per tensor that is not equal in both (``-``, ``+``, ``!``, ``~``) or tied in one (``=``), then the
    summary line."""
    lines = [found for found in map(line, report.results) if found is not None]
    return "\n".join([*lines, summary_line(report)])


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def to_json(report: Report) -> dict[str, Any]:
    """The ``--json`` document: ``{"a", "b", "tensors", "summary"}``."""
    tensors = []
    for result in report.results:
        entry: dict[str, Any] = {
            "name": result.name,
            "status": result.status,
            "dtype": [t.dtype if t is not None else None for t in (result.a, result.b)],
            "shape": [list(t.shape) if t is not None else None for t in (result.a, result.b)],
        }
        if result.compared:
            entry |= {
                "differ": result.differ,
                "max_abs": _finite(result.max_abs),
                "where": result.where,
                "rel_l2": _finite(result.rel_l2),
            }
            if result.nonfinite is not None:
                entry["nonfinite"] = result.nonfinite
        if result.tied_to is not None:
            entry["tied_to"] = result.tied_to
        tensors.append(entry)
    return {"a": report.a, "b": report.b, "tensors": tensors, "summary": report.counts}


def render_json(report: Report) -> str:
    """``to_json``'s document, a tensor a line (``grep``-able, and short for models of thousands of tensors)."""
    document = to_json(report)

    def dump(value: object) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)

    tensors = "".join(f"\n    {dump(entry)}," for entry in document["tensors"]).rstrip(",")
    return (
        f'{{\n  "a": {dump(document["a"])},\n  "b": {dump(document["b"])},\n'
        f'  "tensors": [{tensors}\n  ],\n  "summary": {dump(document["summary"])}\n}}'
    )
