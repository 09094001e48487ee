#!/usr/bin/env python3
"""Differential fuzzing of stfs's header validation against the safetensors reference.

Seeds are files written by the real ``safetensors`` package; each input is one seed mutated at the byte,
JSON or file level. stfs's verdict (``stfs.formats.safetensors.fetch_header``, what ``stfs check`` runs)
is compared with the reference's (``safetensors.deserialize`` and ``safe_open``). A failure is

- a disagreement that is not one of the documented places where stfs is stricter (docs/validation.md:
  a header that does not begin with ``{``, a repeated key), each confirmed here
  independently of stfs's own error class; or
- an exception from stfs that is not an ``StfsError``.

Each failure is printed with a minimal input, shrunk while it still fails the same way. The two verdicts and
how they are compared are the tests' own (tests/verdicts.py).

    python3 fuzz/fuzz_reference.py --inputs 3000 --seed 1      # what tests/test_reference.py runs
    python3 fuzz/fuzz_reference.py --minutes 10 --json out.json
    python3 fuzz/fuzz_reference.py --validate tests.verdicts:lenient_verdict   # a planted fault: found and shrunk
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import random
import re
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: this checkout's stfs, and the tests' writers and verdicts
    sys.path.insert(0, REPO)

from stfs.formats.safetensors import DTYPE_BITS  # noqa: E402
from tests.models import SERIALIZE_NAMES  # noqa: E402
from tests.verdicts import NUMBERS, Verdict, boundary_number, judge, stfs_verdict  # noqa: E402

# The dtypes safetensors.serialize can write (F6_* only appear through JSON mutations).
WRITABLE = SERIALIZE_NAMES
ALL_DTYPES = [*WRITABLE, "F6_E2M3", "F6_E3M2"]
BAD_DTYPES = ["", "f32", "F128", "F6", "F8", "FP8", "bf16", "BF16 ", "U1", "Q4_0", "F4_E2M1", "B"]
NAMES = [
    "",
    ".",
    "..",
    "a..b",
    "a/b",
    "%",
    "\x00",
    "é",
    "🦀",
    'q"uote',
    "back\\slash",
    "tab\there",
    "__metadata__",
    "__METADATA__",
    "model.layers.0.mlp.up_proj.weight",
    "x" * 300,
]
INVALID_NUMBERS = ["NaN", "Infinity", "-Infinity", "01", "1.", ".5", "+1", "0x10", "1_0", "1e", "--1", "-"]
BYTES = [b"{", b"}", b"[", b"]", b'"', b"\\", b":", b",", b" ", b"\t", b"\n", b"\x00", b"\x80", b"\xff", b"\xc3"]
TOKENS = [
    b"null",
    b"true",
    b"-",
    b"0",
    b"e",
    b".",
    b"\\u",
    b"\\ud800",
    b"\\udc00",
    b'\\"',
    b"\xef\xbb\xbf",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xc0\xaf",
]
MUTATORS: dict[str, Callable[[random.Random, bytes], bytes]] = {}


@dataclass(frozen=True, slots=True)
class Failure:
    signature: str
    mutation: str
    stfs: Verdict
    reference: Verdict
    minimal: bytes


@dataclass(slots=True)
class Report:
    inputs: int = 0
    seconds: float = 0.0
    by_mutation: Counter[str] = field(default_factory=Counter)
    agreements: Counter[str] = field(default_factory=Counter)
    same_class: Counter[str] = field(default_factory=Counter)
    disagreements: Counter[str] = field(default_factory=Counter)
    crashes: Counter[str] = field(default_factory=Counter)
    reference_splits: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.disagreements.values()) + sum(self.crashes.values())


# -- seeds -----------------------------------------------------------------------------------------------------------


def make_seeds(rng: random.Random, count: int = 24) -> list[bytes]:
    """Files written by ``safetensors.serialize``: every writable dtype, 0-d and empty tensors, odd names, metadata."""
    seeds = []
    for index in range(count):
        specs = {}
        keep = []  # the buffers the specs point into, alive until serialize has run
        for number in range(rng.randint(0, 5) if index else 0):
            dtype = rng.choice(list(WRITABLE))
            shape = [rng.choice([0, 1, 2, 3, 4, 8]) for _ in range(rng.randint(0, 3))]
            if dtype == "F4":  # two values a byte, and TensorSpec takes the shape of the bytes
                shape = [*shape[:-1], shape[-1] // 2 * 2] if shape else [2]
            size = math.prod(shape) * DTYPE_BITS[dtype] // 8
            buffer = np.frombuffer(rng.randbytes(size or 1), dtype=np.uint8).copy()
            keep.append(buffer)
            name = rng.choice(NAMES) + str(number) if rng.random() < 0.3 else f"model.layers.{number}.w"
            storage = [*shape[:-1], shape[-1] // 2] if dtype == "F4" else shape
            specs[name] = safetensors.TensorSpec(
                dtype=WRITABLE[dtype], shape=storage, data_ptr=buffer.ctypes.data, data_len=size
            )
        metadata = {rng.choice(NAMES): rng.choice(NAMES) for _ in range(rng.randint(0, 3))} if index % 3 else None
        seeds.append(bytes(safetensors.serialize(specs, metadata=metadata)))
    return seeds


# -- mutations -------------------------------------------------------------------------------------------------------


def mutator(name: str) -> Callable[[Callable[[random.Random, bytes], bytes]], Callable[[random.Random, bytes], bytes]]:
    def register(function: Callable[[random.Random, bytes], bytes]) -> Callable[[random.Random, bytes], bytes]:
        MUTATORS[name] = function
        return function

    return register


def split(data: bytes) -> tuple[bytes, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + length], data[8 + length :]


def join(header: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def _position(rng: random.Random, header: bytes) -> int:
    return rng.randrange(len(header) + 1)


@mutator("byte: flip a bit")
def flip_bit(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    if not header:
        return data
    edited = bytearray(header)
    edited[rng.randrange(len(edited))] ^= 1 << rng.randrange(8)
    return join(bytes(edited), body)


@mutator("byte: replace")
def replace_byte(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    if not header:
        return data
    at = rng.randrange(len(header))
    return join(header[:at] + rng.choice(BYTES) + header[at + 1 :], body)


@mutator("byte: insert")
def insert_bytes(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    at = _position(rng, header)
    return join(header[:at] + rng.choice(BYTES + TOKENS) + header[at:], body)


@mutator("byte: delete")
def delete_bytes(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    at = _position(rng, header)
    return join(header[:at] + header[at + rng.randint(1, 8) :], body)


@mutator("byte: duplicate a span")
def duplicate_span(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    start = _position(rng, header)
    end = min(len(header), start + rng.randint(1, 64))
    at = _position(rng, header)
    return join(header[:at] + header[start:end] + header[at:], body)


class Pairs(list):  # type: ignore[type-arg]
    """A JSON object as its list of (key, value) pairs: order and repeated keys kept."""


@dataclass(frozen=True, slots=True)
class Literal:
    text: str


def parse(header: bytes) -> Pairs:
    """The header as nested ``Pairs``, numbers kept as written; ValueError if it is not a JSON object."""
    document = json.loads(header.decode("utf-8"), object_pairs_hook=Pairs, parse_int=Literal, parse_float=Literal)
    if not isinstance(document, Pairs):
        raise ValueError("not a JSON object")
    return document


def emit(value: Any, rng: random.Random | None = None, ascii_only: bool = True) -> str:
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{emit(k, rng, ascii_only)}:{emit(v, rng, ascii_only)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(emit(v, rng, ascii_only) for v in value) + "]"
    if isinstance(value, Literal):
        return value.text
    return json.dumps(value, ensure_ascii=ascii_only)


def tensors(document: Pairs) -> list[Pairs]:
    return [info for key, info in document if key != "__metadata__" and isinstance(info, Pairs)]


def json_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.random()
    if depth < 3 and choice < 0.15:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 3 and choice < 0.3:
        return Pairs((rng.choice(NAMES), json_value(rng, depth + 1)) for _ in range(rng.randint(0, 3)))
    if choice < 0.6:
        return Literal(rng.choice(NUMBERS) if rng.random() < 0.6 else boundary_number(rng))
    if choice < 0.65:
        return Literal(rng.choice(INVALID_NUMBERS))
    if choice < 0.75:
        return rng.choice([None, True, False])
    return rng.choice(NAMES + ALL_DTYPES)


def nested(rng: random.Random, containers: int) -> Literal:
    """A JSON value of exactly ``containers`` nested arrays or objects."""
    if rng.random() < 0.5:
        return Literal("[" * containers + "]" * containers)
    return Literal('{"k":' * (containers - 1) + "{}" + "}" * (containers - 1))


@mutator("json: dtype")
def mutate_dtype(rng: random.Random, data: bytes) -> bytes:
    return _edit_tensor(rng, data, "dtype", lambda _: rng.choice(ALL_DTYPES + BAD_DTYPES + [None, 1]))


@mutator("json: shape")
def mutate_shape(rng: random.Random, data: bytes) -> bytes:
    def edit(shape: Any) -> Any:
        if not isinstance(shape, list) or not shape or rng.random() < 0.2:
            return rng.choice([[], [Literal("0")], Literal("1"), None, "x", [[Literal("1")]], Pairs()])
        shape = list(shape)
        at = rng.randrange(len(shape))
        choice = rng.random()
        if choice < 0.4:
            old = int(shape[at].text) if isinstance(shape[at], Literal) and shape[at].text.isdigit() else 1
            shape[at] = Literal(str(max(0, old + rng.choice([-1, 1, 2, old]))))
        elif choice < 0.7:
            shape[at] = Literal(rng.choice(NUMBERS + INVALID_NUMBERS[:3]))
        elif choice < 0.85:
            shape.insert(at, Literal(rng.choice(["0", "1", "2", "4294967296", "18446744073709551615"])))
        else:
            del shape[at]
        return shape

    return _edit_tensor(rng, data, "shape", edit)


@mutator("json: data_offsets")
def mutate_offsets(rng: random.Random, data: bytes) -> bytes:
    def edit(offsets: Any) -> Any:
        if not isinstance(offsets, list) or len(offsets) != 2 or rng.random() < 0.2:
            return rng.choice([[], [Literal("0")], [Literal("0")] * 3, None, Literal("0"), ["0", "0"]])
        offsets = list(offsets)
        at = rng.randrange(2)
        old = int(offsets[at].text) if isinstance(offsets[at], Literal) and offsets[at].text.isdigit() else 0
        if rng.random() < 0.7:
            offsets[at] = Literal(str(max(0, old + rng.choice([-2, -1, 1, 2, 8]))))
        else:
            offsets[at] = Literal(rng.choice(NUMBERS))
        return offsets

    return _edit_tensor(rng, data, "data_offsets", edit)


def _edit_tensor(rng: random.Random, data: bytes, member: str, edit: Callable[[Any], Any]) -> bytes:
    header, body = split(data)
    document = parse(header)
    infos = tensors(document)
    if not infos:
        return data
    info = rng.choice(infos)
    for index, (key, value) in enumerate(info):
        if key == member:
            info[index] = (key, edit(value))
    return rewrite(rng, document, body)


@mutator("json: extra member")
def extra_member(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    document = parse(header)
    infos = tensors(document)
    target = rng.choice(infos) if infos and rng.random() < 0.7 else document
    value: Any = json_value(rng)
    if rng.random() < 0.4:  # around the reference's limit of 127 containers (the header and a tensor's info count)
        value = nested(rng, rng.choice([125, 126, 127, 128, 300]) - (2 if target is not document else 1))
    target.insert(rng.randint(0, len(target)), (rng.choice(["x", "quant", "dtype2", ""]), value))
    return rewrite(rng, document, body)


@mutator("json: remove member")
def remove_member(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    document = parse(header)
    target = rng.choice([document, *tensors(document)])
    if target:
        del target[rng.randrange(len(target))]
    return rewrite(rng, document, body)


@mutator("json: repeat a key")
def repeat_key(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    document = parse(header)
    target = rng.choice([document, *tensors(document), *(v for k, v in document if k == "__metadata__")])
    if not isinstance(target, Pairs) or not target:
        target = document
        target.append(("__metadata__", Pairs()))
    key, value = rng.choice(target)
    if rng.random() < 0.5 and isinstance(value, Pairs):
        value = Pairs(value)
    target.insert(rng.randint(0, len(target)), (key, value))
    return rewrite(rng, document, body)


@mutator("json: metadata")
def mutate_metadata(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    document = parse(header)
    document[:] = [(k, v) for k, v in document if k != "__metadata__"]
    choice = rng.random()
    if choice < 0.5:
        metadata: Any = Pairs((rng.choice(NAMES), rng.choice(NAMES)) for _ in range(rng.randint(0, 3)))
        if metadata and rng.random() < 0.6:
            metadata[rng.randrange(len(metadata))] = (rng.choice(NAMES), json_value(rng))
    elif choice < 0.7:
        metadata = Pairs([("k", nested(rng, rng.choice([1, 124, 125, 126, 127])))])
    else:
        metadata = json_value(rng)
    document.insert(rng.randint(0, len(document)), ("__metadata__", metadata))
    return rewrite(rng, document, body)


@mutator("json: rename a tensor")
def rename_tensor(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    document = parse(header)
    if not document:
        return data
    at = rng.randrange(len(document))
    name = rng.choice(NAMES + ["\ud800", "\udfff", "\ud83e\udd80", "a\u0000b"])
    document[at] = (name, document[at][1])
    return rewrite(rng, document, body)


@mutator("json: top-level value")
def top_level(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    document = parse(header)
    if document and rng.random() < 0.7:
        at = rng.randrange(len(document))
        document[at] = (document[at][0], json_value(rng))
        return rewrite(rng, document, body)
    return join(emit(json_value(rng)).encode(), body)


@mutator("json: whitespace and numbers spelled otherwise")
def respell(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    text = emit(parse(header), ascii_only=rng.random() < 0.5)
    choice = rng.random()
    if choice < 0.3:
        text = json.dumps(json.loads(text), indent=rng.choice([0, 1, "\t"]), ensure_ascii=False)
    elif choice < 0.6:
        numbers = list(re.finditer(r"(?<=[\[,:])\d+", text))
        if numbers:
            hit = rng.choice(numbers)
            spelled = rng.choice(["{}.0", "{}e0", "{}E+0", "0{}", "-{}", "{}.", "+{}", " {} "]).format(hit.group())
            text = text[: hit.start()] + spelled + text[hit.end() :]
    elif choice < 0.8:
        text = rng.choice([" ", "\t", "\n", "\r", "\ufeff", ""]) + text
    else:
        text += rng.choice([" " * 7, "\t", "\n", "\x00", "\r\n", "  x"])
    return join(text.encode("utf-8", "surrogatepass"), body)


def rewrite(rng: random.Random, document: Any, body: bytes) -> bytes:
    """The edited document with its length prefix; the data section often resized to what the tensors need."""
    text = emit(document, rng, ascii_only=rng.random() < 0.5)
    header = text.encode("utf-8", "surrogatepass")
    header += b" " * (-len(header) % 8 if rng.random() < 0.5 else 0)
    if rng.random() < 0.6:
        end = 0
        for info in tensors(document) if isinstance(document, Pairs) else []:
            for key, value in info:
                if key == "data_offsets" and isinstance(value, list):
                    for item in value:
                        if isinstance(item, Literal) and item.text.isdigit() and len(item.text) < 7:
                            end = max(end, int(item.text))
        body = (body + b"\0" * end)[:end]
    return join(header, body)


@mutator("file: truncate")
def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


@mutator("file: append")
def append(rng: random.Random, data: bytes) -> bytes:
    return data + rng.randbytes(rng.choice([1, 2, 7, 8, 64]))


@mutator("file: length prefix")
def length_prefix(rng: random.Random, data: bytes) -> bytes:
    (length,) = struct.unpack("<Q", data[:8])
    new = rng.choice(
        [
            length + rng.choice([-8, -2, -1, 1, 2, 8]),
            0,
            len(data) - 8,
            len(data) - 7,
            100_000_000,
            100_000_001,
            2**32,
            2**63,
            2**64 - 1,
            rng.getrandbits(64),
        ]
    )
    return struct.pack("<Q", new % 2**64) + data[8:]


@mutator("file: data section")
def data_section(rng: random.Random, data: bytes) -> bytes:
    header, body = split(data)
    choice = rng.random()
    if choice < 0.4 and body:
        return join(header, body[: rng.randrange(len(body))])
    if choice < 0.7:
        return join(header, body + b"\0" * rng.choice([1, 8]))
    return join(header + b" " * rng.randint(1, 9), body)


@mutator("file: tiny")
def tiny(rng: random.Random, data: bytes) -> bytes:
    return rng.choice([b"", b"\0" * rng.randint(1, 7), struct.pack("<Q", 0), struct.pack("<Q", 2) + b"{}"])


def mutate(rng: random.Random, seed: bytes) -> tuple[str, bytes]:
    """One mutation class, applied once or a few times (later byte edits may stack on a JSON edit)."""
    name = rng.choice(list(MUTATORS))
    data = seed
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            data = MUTATORS[name](rng, data)
        except (ValueError, UnicodeDecodeError, RecursionError, struct.error, IndexError):
            break  # the input no longer has what this mutator edits: keep it as it is
    return name, data


# -- shrinking -------------------------------------------------------------------------------------------------------


def shrink(data: bytes, still_fails: Callable[[bytes], bool], budget: float = 20.0) -> bytes:
    """A smaller input that still fails: whole JSON members and elements dropped first, then spans of bytes."""
    deadline = time.monotonic() + budget
    for _ in range(3):
        before = data
        data = _shrink_bytes(_shrink_json(data, still_fails, deadline), still_fails, deadline)
        if data == before:
            break
    return data


def _shrink_bytes(data: bytes, still_fails: Callable[[bytes], bool], deadline: float) -> bytes:
    consistent = len(data) >= 8 and 8 + struct.unpack("<Q", data[:8])[0] <= len(data)

    def whole(pieces: list[bytes]) -> bytes:  # the length prefix kept right where it was
        return join(pieces[0], pieces[1]) if consistent else pieces[0]

    pieces = list(split(data)) if consistent else [data]
    for which in range(len(pieces)):
        size = max(1, len(pieces[which]) // 2)
        while size >= 1 and time.monotonic() < deadline:
            start = 0
            while start < len(pieces[which]) and time.monotonic() < deadline:
                trial = list(pieces)
                trial[which] = trial[which][:start] + trial[which][start + size :]
                if still_fails(whole(trial)):
                    pieces = trial
                else:
                    start += size
            size //= 2
    return whole(pieces)


def _shrink_json(data: bytes, still_fails: Callable[[bytes], bool], deadline: float) -> bytes:
    """Drop one member or element at a time (deepest containers last) while the input still fails."""
    try:
        header, body = split(data)
        if 8 + len(header) + len(body) != len(data) or len(header) != struct.unpack("<Q", data[:8])[0]:
            return data
        document = parse(header)
    except (ValueError, UnicodeDecodeError, RecursionError, struct.error):
        return data
    canonical = join(emit(document).encode("utf-8", "surrogatepass"), body)
    if canonical != data:
        if not still_fails(canonical):
            return data  # what fails is in how it is written (spacing, escapes, padding)
        data = canonical
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for trial in _smaller(document):
            candidate = join(emit(trial).encode("utf-8", "surrogatepass"), body)
            if still_fails(candidate):
                document, data, progress = trial, candidate, True
                break
    return data


def _smaller(document: Any) -> Iterator[Any]:
    """Copies of ``document``, each with one member or element removed, outermost first."""
    containers: list[tuple[Any, ...]] = []
    stack: list[tuple[Any, tuple[int, ...]]] = [(document, ())]
    while stack:
        value, route = stack.pop(0)
        if isinstance(value, list):
            containers.append(route)
            for index, item in enumerate(value):
                inner = item[1] if isinstance(value, Pairs) else item
                stack.append((inner, (*route, index)))
    for route in containers:
        size = len(_at(document, route))
        for index in range(size):
            trial = copy.deepcopy(document)
            del _at(trial, route)[index]
            yield trial


def _at(document: Any, route: tuple[int, ...]) -> Any:
    for index in route:
        document = document[index][1] if isinstance(document, Pairs) else document[index]
    return document


# -- the run ---------------------------------------------------------------------------------------------------------


def run(
    seed: int = 1,
    inputs: int | None = 3000,
    seconds: float | None = None,
    work_dir: str | None = None,
    validate: Callable[[str], Verdict] = stfs_verdict,
    max_failures: int = 10,
    progress: Callable[[Report], None] | None = None,
) -> Report:
    """Fuzz ``inputs`` inputs, or for ``seconds``; each distinct failure signature is shrunk and kept once."""
    rng = random.Random(seed)
    folder = work_dir or tempfile.mkdtemp(prefix="stfs-fuzz-reference-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "input.safetensors")
    seeds = make_seeds(rng)
    report = Report()
    started = time.monotonic()
    last_progress = started
    while (inputs is None or report.inputs < inputs) and (seconds is None or time.monotonic() - started < seconds):
        mutation, data = mutate(rng, rng.choice(seeds))
        outcome = judge(data, path, validate)
        report.inputs += 1
        report.by_mutation[mutation] += 1
        if outcome.split:
            report.reference_splits[f"deserialize and safe_open disagree: {outcome.reference.kind}"] += 1
        if outcome.signature is None:
            report.agreements[outcome.agreement] += 1
            if outcome.agreement.startswith("both refuse"):
                same = outcome.stfs.kind == outcome.reference.kind or (
                    outcome.reference.kind == "InvalidHeaderUtf8" and outcome.stfs.kind == "InvalidHeaderStart"
                )
                report.same_class["same rule" if same else f"{outcome.reference.kind} / {outcome.stfs.kind}"] += 1
        else:
            counter = report.crashes if outcome.stfs.crash else report.disagreements
            counter[outcome.signature] += 1
            known = {failure.signature for failure in report.failures}
            if outcome.signature not in known and len(report.failures) < max_failures:
                signature = outcome.signature
                minimal = shrink(data, lambda trial, wanted=signature: judge(trial, path, validate).signature == wanted)
                final = judge(minimal, path, validate)
                report.failures.append(Failure(signature, mutation, final.stfs, final.reference, minimal))
                print_failure(report.failures[-1])
        if progress is not None and time.monotonic() - last_progress > 30:
            last_progress = time.monotonic()
            progress(report)
    report.seconds = time.monotonic() - started
    return report


def print_failure(failure: Failure) -> None:
    print(f"FAILURE: {failure.signature} (from {failure.mutation})", file=sys.stderr)
    print(f"  stfs:      {failure.stfs.kind}: {failure.stfs.message[:300]}", file=sys.stderr)
    print(f"  reference: {failure.reference.kind}: {failure.reference.message[:300]}", file=sys.stderr)
    print(f"  minimal input ({len(failure.minimal)} bytes): {failure.minimal!r:.2000}", file=sys.stderr, flush=True)


def summary(report: Report) -> dict[str, Any]:
    return {
        "inputs": report.inputs,
        "seconds": round(report.seconds, 1),
        "inputs by mutation": {name: report.by_mutation[name] for name in sorted(MUTATORS)},
        "agreements": dict(report.agreements.most_common()),
        "both refuse, for which rule": dict(report.same_class.most_common()),
        "disagreements": dict(report.disagreements.most_common()),
        "crashes": dict(report.crashes.most_common()),
        "reference splits": dict(report.reference_splits.most_common()),
        "failures": [
            {"signature": f.signature, "mutation": f.mutation, "minimal": repr(f.minimal)} for f in report.failures
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inputs", type=int, help="how many inputs (default 3000, or unbounded with --minutes)")
    parser.add_argument("--minutes", type=float, help="run for this long")
    parser.add_argument("--work-dir", help="where the input file is written (default: a new temporary folder)")
    parser.add_argument("--json", help="write the figures to this file as JSON")
    parser.add_argument(
        "--validate",
        metavar="MODULE:FUNCTION",
        help="judge this validator (a function from a file's path to a tests.verdicts.Verdict) instead of stfs's",
    )
    args = parser.parse_args(argv)
    validate = stfs_verdict
    if args.validate:
        module, _, name = args.validate.partition(":")
        validate = getattr(importlib.import_module(module), name)
    inputs = args.inputs if args.inputs is not None or args.minutes is not None else 3000
    seconds = args.minutes * 60 if args.minutes is not None else None

    def progress(report: Report) -> None:
        print(f"{report.inputs} inputs, {report.failed} failing", file=sys.stderr, flush=True)

    report = run(args.seed, inputs, seconds, args.work_dir, validate, progress=progress)
    figures = summary(report)
    text = json.dumps(figures, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        with open(args.json, "w") as stream:
            stream.write(text + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
