#!/usr/bin/env python3
"""Fuzzing the PyTorch checkpoint reader (stfs/formats/pytorch.py) with mutations of real torch.save files.

Seeds are checkpoints the real torch writes (zip and legacy layouts, protocols 2 and 4, a Lightning-style dict,
views, tied weights, a whole module). Each input is one seed mutated: bytes of its pickle flipped, overwritten
with boundary integers, cut, repeated or spliced with hostile snippets (then wrapped in a valid zip again, so the
interpreter is what is tested), or the file itself mutated (end records, central directory, local headers, the
legacy counts). A failure is

- an exception from the reader that is not an ``StfsError``;
- an accepted file whose tensors do not lie inside their storages and the file, or whose safetensors header
  cannot be made;
- with ``--torch``: a file ``torch.load(weights_only=True)`` and stfs both accept whose tensors differ (names,
  dtypes, shapes, bytes), for the plain dicts of tensors torch returns.

    python3 scripts/fuzz_pickle.py --inputs 2000 --seed 1          # what tests/test_pytorch_format.py runs, less
    python3 scripts/fuzz_pickle.py --seconds 600 --torch
    python3 scripts/fuzz_pickle.py --hostile                        # time and memory of the hostile pickles

Also the tools the tests build hand-made checkpoints with: ``write_zip`` (stored entries, torch's 64-byte
alignment, ZIP64 on request), a small pickle assembler, and the hostile pickles of SPEC §12.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import struct
import subprocess
import sys
import time
import traceback
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stfs import errors
from stfs.formats import pytorch

# -- a zip writer: stored entries as torch writes them ----------------------------------------------------------


def write_zip(
    entries: Sequence[tuple[str, bytes]],
    *,
    zip64: bool = False,
    align: int = 64,
    deflate: Sequence[str] = (),
    comment: bytes = b"",
) -> bytes:
    """A zip of ``entries`` (name, data): stored (``deflate`` names are deflated), data aligned to ``align`` bytes
    by padding in the local extra field as torch does, ZIP64 extra fields and end records with ``zip64``."""
    out = bytearray()
    central = bytearray()
    for name, data in entries:
        raw_name = name.encode("utf-8")
        method = 8 if name in deflate else 0
        body = zlib.compress(data)[2:-4] if method else data
        crc = zlib.crc32(data)
        offset = len(out)
        local_extra = b""
        if zip64:
            local_extra += struct.pack("<HHQQ", 1, 16, len(data), len(body))
        if align:
            start = offset + 30 + len(raw_name) + len(local_extra) + 4
            pad = -start % align
            local_extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB", torch's tag
        small = 0xFFFFFFFF if zip64 else None
        out += struct.pack(
            "<4s2B4HL2L2H",
            b"PK\x03\x04",
            45 if zip64 else 20,
            0,
            0x800,
            method,
            0,
            0x21,
            crc,
            small if small is not None else len(body),
            small if small is not None else len(data),
            len(raw_name),
            len(local_extra),
        )
        out += raw_name + local_extra + body
        central_extra = struct.pack("<HHQQQ", 1, 24, len(data), len(body), offset) if zip64 else b""
        central += struct.pack(
            "<4s4B4HL2L5H2L",
            b"PK\x01\x02",
            45 if zip64 else 20,
            3,
            45 if zip64 else 20,
            0,
            0x800,
            method,
            0,
            0x21,
            crc,
            small if small is not None else len(body),
            small if small is not None else len(data),
            len(raw_name),
            len(central_extra),
            0,
            0,
            0,
            0,
            small if small is not None else offset,
        )
        central += raw_name + central_extra
    cd_offset = len(out)
    out += central
    count = len(entries)
    if zip64:
        z64 = len(out)
        out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(central), cd_offset)
        out += struct.pack("<4sLQL", b"PK\x06\x07", 0, z64, 1)
    out += struct.pack(
        "<4s4H2LH",
        b"PK\x05\x06",
        0,
        0,
        0xFFFF if zip64 else count,
        0xFFFF if zip64 else count,
        0xFFFFFFFF if zip64 else len(central),
        0xFFFFFFFF if zip64 else cd_offset,
        len(comment),
    )
    return bytes(out + comment)


def checkpoint_zip(
    pickle_bytes: bytes,
    storages: dict[str, bytes] | None = None,
    *,
    top: str = "archive",
    byteorder: bytes | None = b"little",
    extra: Sequence[tuple[str, bytes]] = (),
    **options: Any,
) -> bytes:
    """A checkpoint laid out as torch.save lays it out, around a given pickle and storages."""
    entries = [(f"{top}/data.pkl", pickle_bytes)]
    if byteorder is not None:
        entries.append((f"{top}/byteorder", byteorder))
    entries += [(f"{top}/data/{key}", data) for key, data in (storages or {}).items()]
    entries += [(f"{top}/version", b"3\n"), *extra]
    return write_zip(entries, **options)


# -- a pickle assembler -----------------------------------------------------------------------------------------

PROTO2 = b"\x80\x02"
STOP = b"."
MARK = b"("


def p_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def p_str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def p_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def p_binstring(text: str) -> bytes:
    """A Python 2 ``str`` (SHORT_BINSTRING), as checkpoints pickled by Python 2 hold names."""
    raw = text.encode("utf-8")
    return b"U" + bytes([len(raw)]) + raw


def p_tuple(*parts: bytes) -> bytes:
    return MARK + b"".join(parts) + b"t"


def p_dict(items: Sequence[tuple[bytes, bytes]]) -> bytes:
    return b"}" + MARK + b"".join(key + value for key, value in items) + b"u"


def p_tensor(
    key: str,
    numel: int,
    offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    storage: str = "FloatStorage",
) -> bytes:
    """``_rebuild_tensor_v2`` of storage ``key`` (``numel`` elements of ``storage``), as torch.save pickles it."""
    pid = p_tuple(p_str("storage"), p_global("torch", storage), p_str(key), p_str("cpu"), p_int(numel)) + b"Q"
    args = p_tuple(
        pid,
        p_int(offset),
        p_tuple(*map(p_int, shape)),
        p_tuple(*map(p_int, strides)),
        b"\x89",
        p_global("collections", "OrderedDict") + b")R",
    )
    return p_global("torch._utils", "_rebuild_tensor_v2") + args + b"R"


def legacy_file(
    object_pickle: bytes, storages: Sequence[tuple[str, int, bytes]], *, little_endian: bool = True
) -> bytes:
    """A file in the format before the zip (``_use_new_zipfile_serialization=False``): the magic number, the
    protocol, sys_info, the object, the storage keys; then each storage (key, element count, bytes) in order."""
    sys_info = p_dict(
        [
            (p_binstring("protocol_version"), p_int(pytorch.LEGACY_PROTOCOL)),
            (p_binstring("little_endian"), b"\x88" if little_endian else b"\x89"),
        ]
    )
    out = PROTO2 + p_int(pytorch.LEGACY_MAGIC) + STOP + PROTO2 + p_int(pytorch.LEGACY_PROTOCOL) + STOP
    out += PROTO2 + sys_info + STOP + object_pickle
    out += PROTO2 + b"]" + MARK + b"".join(p_binstring(key) for key, _, _ in storages) + b"e" + STOP
    for _, count, data in storages:
        out += struct.pack("<q", count) + data
    return out


def state_dict_pickle(tensors: Sequence[tuple[str, bytes]]) -> bytes:
    """A protocol-2 pickle of a dict of name -> pickled value."""
    return PROTO2 + p_dict([(p_str(name), value) for name, value in tensors]) + STOP


# -- the hostile pickles of SPEC §12 -----------------------------------------------------------------------------


def billion_laughs(levels: int = 40, width: int = 10, tensor: bool = True) -> bytes:
    """A list of ``width`` references to the list before it, ``levels`` times: width**levels leaves to walk."""
    out = bytearray(PROTO2 + b"}" + p_str("x"))
    out += b"]" + (p_tensor("0", 4, 0, (4,), (1,)) if tensor else p_str("lol")) + b"a" + b"r" + struct.pack("<I", 0)
    for level in range(1, levels + 1):
        out += b"0]" + MARK + (b"j" + struct.pack("<I", level - 1)) * width + b"e"  # POP the level before, then
        out += b"r" + struct.pack("<I", level)
    out += b"s" + STOP
    return bytes(out)


def deep_nesting(depth: int = 100_000, kind: str = "list") -> bytes:
    """Containers ``depth`` deep: lists appended into each other, tuples of one, dicts, or marks left open."""
    if kind == "list":
        body = b"]" * depth + b"a" * (depth - 1)
    elif kind == "tuple":
        body = b")" + b"\x85" * depth
    elif kind == "dict":
        body = (b"}" + p_str("k")) * depth + b"N" + b"s" * depth
    elif kind == "marks":
        body = MARK * depth + b"N" + b"t" * depth
    elif kind == "key":  # a tuple that deep as a dict key: never hashed
        body = b"}" + b")" + b"\x85" * depth + b"Ns"
    else:
        raise ValueError(kind)
    return PROTO2 + body + STOP


def long_string(kind: str = "unicode8") -> bytes:
    """A string, bytes or integer whose length says far more than the file holds."""
    if kind == "unicode8":
        return PROTO2 + b"\x8d" + struct.pack("<Q", 1 << 62) + b"abc" + STOP
    if kind == "bytes8":
        return PROTO2 + b"\x8e" + struct.pack("<Q", (1 << 64) - 1) + STOP
    if kind == "unicode":
        return PROTO2 + b"X" + struct.pack("<I", 0xFFFFFFFF) + b"abc" + STOP
    if kind == "long4":
        return PROTO2 + b"\x8b" + struct.pack("<i", 2**31 - 1) + STOP
    if kind == "line":
        return PROTO2 + b"c" + b"a" * (1 << 20) + STOP
    raise ValueError(kind)


def many_opcodes(count: int = pytorch.MAX_OPCODES + 10) -> bytes:
    return PROTO2 + b"N0" * (count // 2) + b"N" + STOP


def memo_flood(count: int = pytorch.MAX_MEMO + 10) -> bytes:
    return PROTO2 + b"N" + b"".join(b"r" + struct.pack("<I", i) for i in range(count)) + STOP


HOSTILE: dict[str, Callable[[], bytes]] = {
    "billion laughs (40 levels of 10)": lambda: billion_laughs(),
    "billion laughs of strings": lambda: billion_laughs(tensor=False),
    "100,000-deep lists": lambda: deep_nesting(100_000, "list"),
    "100,000-deep tuples": lambda: deep_nesting(100_000, "tuple"),
    "100,000-deep dicts": lambda: deep_nesting(100_000, "dict"),
    "100,000 open marks": lambda: deep_nesting(100_000, "marks"),
    "a string of 2^62 bytes": lambda: long_string("unicode8"),
    "bytes of 2^64-1 bytes": lambda: long_string("bytes8"),
    "a 2^31-byte integer": lambda: long_string("long4"),
    "a 1 MiB GLOBAL line": lambda: long_string("line"),
    "2,000,010 opcodes": lambda: many_opcodes(),
    "1,000,010 memo entries": lambda: memo_flood(),
}


def hostile_checkpoint(name: str) -> bytes:
    """The hostile pickle ``name`` as the data.pkl of a zip checkpoint (with a storage it may name)."""
    return checkpoint_zip(HOSTILE[name](), {"0": bytes(16)})


_CHILD = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
resource.setrlimit(resource.RLIMIT_CPU, ({seconds}, {seconds}))
from stfs import errors
from stfs.formats import pytorch
data = open(sys.argv[1], "rb").read()
started = time.monotonic()
try:
    pytorch.read_checkpoint(lambda o, n: data[o:o + n], len(data), path=sys.argv[1])
    outcome = ["accepted", time.monotonic() - started]
except errors.StfsError as exc:
    outcome = ["refused", time.monotonic() - started, type(exc).__name__, str(exc)]
# The peak resident set of this process image (ru_maxrss would count the parent's, inherited through fork).
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(peak * 1024, *outcome)
"""


@dataclass
class Bounded:
    """One hostile file read in a child process under RLIMIT_AS and RLIMIT_CPU."""

    outcome: str  # "refused ErrorName", "accepted", or how the child died
    seconds: float  # the reader's own time, as the child measured it
    max_rss: int  # bytes, the child's peak resident set (VmHWM); 0 when it died
    message: str


def read_bounded(path: str, memory: int = 400 << 20, seconds: int = 20) -> Bounded:
    """Read the checkpoint at ``path`` in a child limited to ``memory`` bytes of address space, ``seconds`` of CPU."""
    import tempfile
    import threading

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(memory=memory, seconds=seconds), path],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=root,
            env={**os.environ, "PYTHONPATH": root},
        )
        watchdog = threading.Timer(seconds * 3, child.kill)  # a child asleep uses no CPU: RLIMIT_CPU would not end it
        watchdog.start()
        try:
            assert child.stdout is not None
            out = child.stdout.read().decode("utf-8", "replace")
            child.wait()
        finally:
            watchdog.cancel()
            child.stdout.close()  # type: ignore[union-attr]
        stderr.seek(0)
        errors_text = stderr.read().decode("utf-8", "replace")
    line = out.strip().splitlines()[-1] if out.strip() else ""
    if child.returncode != 0 or not line:
        return Bounded(f"died ({child.returncode})", 0.0, 0, errors_text[-2000:])
    peak, word, took, *rest = line.split(" ", 4)
    outcome = word if word == "accepted" else f"refused {rest[0]}"
    return Bounded(outcome, float(took), int(peak), rest[1] if len(rest) > 1 else "")


# -- seeds: real torch.save files ---------------------------------------------------------------------------------


def make_seeds() -> list[tuple[str, bytes]]:
    """Checkpoints the real torch writes, small enough to mutate fast."""
    import torch

    torch.manual_seed(0)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    plain = {
        "w": base,
        "t": base.t(),
        "col": base[:, 2],
        "tail": base[1:],
        "tied": base,
        "h": torch.ones(3, dtype=torch.float16),
        "i": torch.arange(5, dtype=torch.int64),
        "u": torch.tensor([1, 2, 3]).to(torch.uint16),
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 3),
    }
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    lightning = {
        "epoch": 3,
        "global_step": 10,
        "state_dict": module.state_dict(),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1}]}],
        "hyper_parameters": {"lr": 0.1, "name": "x", "sizes": [1, 2, 3]},
    }
    seeds = []
    for kind, obj, options in (
        ("zip", plain, {}),
        ("zip-protocol4", plain, {"pickle_protocol": 4}),
        ("legacy", plain, {"_use_new_zipfile_serialization": False}),
        ("lightning", lightning, {}),
        ("legacy-lightning", lightning, {"_use_new_zipfile_serialization": False}),
        ("module", module, {}),
        ("list", [base, [base.t(), (torch.zeros(2),)]], {}),
    ):
        buffer = io.BytesIO()
        torch.save(obj, buffer, **options)
        seeds.append((kind, buffer.getvalue()))
    return seeds


# -- mutations ---------------------------------------------------------------------------------------------------

BOUNDARIES = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]
SNIPPETS = [
    b"(",
    b"t",
    b"0",
    b"1",
    b"2",
    b"R",
    b"b",
    b"s",
    b"u",
    b"a",
    b"e",
    b"Q",
    b"\x81",
    b"\x93",
    b"\x94",
    b"h\x00",
    b"h\xff",
    b"q\x00",
    b"j\xff\xff\xff\xff",
    b"r\xff\xff\xff\xff",
    b"\x8d" + struct.pack("<Q", 1 << 40),
    b"\x8e" + struct.pack("<Q", 1 << 40),
    b"X\xff\xff\xff\x7f",
    p_global("posix", "system"),
    p_global("builtins", "eval"),
    p_global("torch._utils", "_rebuild_tensor_v2"),
    p_global("torch._utils", "_rebuild_tensor_v3"),
    p_global("torch._tensor", "_rebuild_from_type_v2"),
    p_global("torch", "FloatStorage"),
    p_global("torch", "complex128"),
    p_str("storage"),
    p_tensor("0", 1 << 40, 0, (1 << 40,), (1,)),
    p_tensor("0", 6, 5, (2, 2), (2**62, 1)),
    b"]" * 50 + b"a" * 49,
    b"(" * 50,
    b"\x95" + struct.pack("<Q", 1 << 50),
    b"\x97",
    b"\x82\x01",
]


def _zip_parts(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def _pickle_of(parts: list[tuple[str, bytes]]) -> int:
    return next(i for i, (name, _) in enumerate(parts) if name.endswith("/data.pkl"))


def _mutate_bytes(rng: random.Random, blob: bytes) -> tuple[str, bytes]:
    data = bytearray(blob)
    choice = rng.randrange(7)
    where = rng.randrange(max(1, len(data)))
    if choice == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return "flip", bytes(data)
    if choice == 1:
        width = rng.choice([1, 2, 4, 8])
        value = rng.choice(BOUNDARIES) & ((1 << (8 * width)) - 1)
        data[where : where + width] = value.to_bytes(width, "little")
        return "boundary", bytes(data)
    if choice == 2:
        return "truncate", bytes(data[:where])
    if choice == 3:
        end = min(len(data), where + rng.randint(1, 64))
        return "delete", bytes(data[:where] + data[end:])
    if choice == 4:
        end = min(len(data), where + rng.randint(1, 64))
        return "repeat", bytes(data[:end] + data[where:end] * rng.randint(1, 4) + data[end:])
    if choice == 5:
        return "snippet", bytes(data[:where] + rng.choice(SNIPPETS) + data[where:])
    other = rng.randrange(max(1, len(data)))
    size = rng.randint(1, 32)
    data[where : where + size] = blob[other : other + size]
    return "splice", bytes(data)


def mutate(rng: random.Random, kind: str, data: bytes) -> tuple[str, bytes]:
    """One mutation of a seed: of its pickle (rewrapped in a valid zip) or of the file itself."""
    if kind.startswith("legacy") or rng.random() < 0.25:
        mutation, mutated = _mutate_bytes(rng, data)
        return f"file {mutation}", mutated
    parts = _zip_parts(data)
    at = _pickle_of(parts)
    mutation, pickle_bytes = _mutate_bytes(rng, parts[at][1])
    parts[at] = (parts[at][0], pickle_bytes)
    if rng.random() < 0.1:  # a storage's size changed as well
        stores = [i for i, (name, _) in enumerate(parts) if "/data/" in name]
        if stores:
            i = rng.choice(stores)
            parts[i] = (parts[i][0], parts[i][1][: rng.randrange(len(parts[i][1]) + 1)])
            mutation += " + storage size"
    return f"pickle {mutation}", write_zip(parts, zip64=rng.random() < 0.3)


# -- judging one input -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    verdict: str  # "accepted", the StfsError's class name, or "crash"
    signature: str | None = None  # a failure: what went wrong, short
    detail: str = ""


def judge(data: bytes, compare_torch: bool = False) -> Outcome:
    def read(offset: int, size: int) -> bytes:
        return data[offset : offset + size]

    try:
        checkpoint = pytorch.read_checkpoint(read, len(data), path="input")
    except errors.StfsError as exc:
        if compare_torch and _torch_loads(data) is not None:
            return Outcome(f"{type(exc).__name__} (torch.load(weights_only=True) accepts)", detail=str(exc))
        return Outcome(type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 (a crash is what the fuzzer looks for)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome("crash", f"{type(exc).__name__} at {frame.name}:{frame.lineno}", traceback.format_exc())
    for tensor in checkpoint.tensors:
        start, size = tensor.span
        if size == 0:  # no element: no byte to lie anywhere (torch accepts any offset for it too)
            continue
        if start < tensor.storage_start or start + size > tensor.storage_start + tensor.storage_size:
            return Outcome("accepted", "tensor outside its storage", tensor.name)
        if tensor.storage_start + tensor.storage_size > len(data):
            return Outcome("accepted", "storage outside the file", tensor.name)
        if tensor.nbytes <= 1 << 16:
            pytorch.gather_into(tensor, read, 0, memoryview(bytearray(tensor.nbytes)))
    try:
        pytorch.safetensors_file(checkpoint.tensors)
    except Exception as exc:  # noqa: BLE001
        return Outcome("accepted", f"no safetensors header: {type(exc).__name__}", str(exc))
    if compare_torch:
        difference = _compare_with_torch(data, checkpoint, read)
        if difference:
            return Outcome("accepted", "differs from torch.load", difference)
    return Outcome("accepted")


def _torch_loads(data: bytes) -> Any:
    """What torch.load(weights_only=True) makes of ``data``, None where it refuses."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 (torch refuses)
        return None


def _compare_with_torch(data: bytes, checkpoint: pytorch.Checkpoint, read: Callable[[int, int], bytes]) -> str:
    import torch

    loaded = _torch_loads(data)
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        return ""
    if not all(type(k) is str for k in loaded):  # a tensor as a key: stfs names its value by a description of it
        return ""
    expected = {
        str(k): v for k, v in loaded.items() if pytorch.TORCH_DTYPES.get(str(v.dtype)[6:], (None,))[0] is not None
    }
    got = {t.name: t for t in checkpoint.tensors}
    if set(expected) != set(got):
        return f"names: torch {sorted(expected)[:5]}, stfs {sorted(got)[:5]}"
    for name, tensor in expected.items():
        mine = got[name]
        if list(tensor.shape) != list(mine.shape):
            return f"{name}: shape {list(tensor.shape)} vs {list(mine.shape)}"
        # Copied into a fresh tensor: contiguous() keeps a mutated stride on a dimension of size 1, which view()
        # then refuses.
        plain = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        raw = plain.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        served = bytearray(mine.nbytes)
        pytorch.gather_into(mine, read, 0, memoryview(served))
        if raw != served:
            return f"{name}: bytes differ"
    return ""


@dataclass
class Report:
    inputs: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    by_mutation: Counter[str] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # signature -> detail (first seen)
    examples: dict[str, str] = field(default_factory=dict)  # a refusal torch.load accepts -> the first one
    slowest: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "verdicts": dict(self.verdicts.most_common()),
            "mutations": dict(self.by_mutation.most_common()),
            "failures": self.failures,
            "stricter_than_torch": self.examples,
            "slowest_input_seconds": round(self.slowest, 4),
        }


def run(seed: int = 1, inputs: int | None = 2000, seconds: float | None = None, compare_torch: bool = False) -> Report:
    """Fuzz ``inputs`` inputs, or for ``seconds``."""
    rng = random.Random(seed)
    seeds = make_seeds()
    report = Report()
    started = time.monotonic()
    while (inputs is None or report.inputs < inputs) and (seconds is None or time.monotonic() - started < seconds):
        kind, data = rng.choice(seeds)
        mutation, mutated = mutate(rng, kind, data)
        began = time.monotonic()
        outcome = judge(mutated, compare_torch)
        report.slowest = max(report.slowest, time.monotonic() - began)
        report.inputs += 1
        report.verdicts[outcome.verdict] += 1
        if "torch.load" in outcome.verdict and outcome.verdict not in report.examples:
            report.examples[outcome.verdict] = f"{kind}, {mutation}: {outcome.detail}"[:500]
        report.by_mutation[mutation.split(" + ")[0]] += 1
        if outcome.signature is not None and outcome.signature not in report.failures:
            report.failures[outcome.signature] = f"{kind}, {mutation}: {outcome.detail}"[:4000]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inputs", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--torch", action="store_true", help="compare accepted files with torch.load(weights_only)")
    parser.add_argument("--hostile", action="store_true", help="time and memory of each hostile pickle, in a child")
    args = parser.parse_args(argv)
    if args.hostile:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="stfs-hostile-") as folder:
            for name in HOSTILE:
                path = os.path.join(folder, "hostile.pt")
                with open(path, "wb") as stream:
                    stream.write(hostile_checkpoint(name))
                result = read_bounded(path)
                print(
                    f"{name:34} {os.path.getsize(path):>10,} B  {result.outcome:36} "
                    f"{result.seconds:6.2f} s  peak RSS {result.max_rss / 2**20:6.1f} MiB"
                )
        return 0
    inputs = args.inputs if args.inputs is not None or args.seconds is not None else 2000
    report = run(seed=args.seed, inputs=inputs, seconds=args.seconds, compare_torch=args.torch)
    print(json.dumps(report.summary(), indent=2))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
