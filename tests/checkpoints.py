"""Hand-made PyTorch checkpoints for the tests and the fuzzer (fuzz/fuzz_pickle.py): a zip writer (stored entries,
torch's 64-byte alignment, ZIP64 on request), a small pickle assembler, the older layout, the hostile pickles of
SPEC §12, a reader of one file in a child held to a memory and CPU limit, and the walk of a gathered tensor's runs
(``walked``: what stfs._native serves, for comparing with the gather routine and torch)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


# -- a gathered tensor's runs, walked ----------------------------------------------------------------------------


def walked(layout: Any, read: Callable[[int, int, str | None], bytes]) -> bytes:
    """The bytes a tensor's layout (``formats.Rows`` and bytes: ``Scattered.layout``) describes, walked run by run
    as stfs._native walks it; ``read(offset, length, file)``."""
    out = bytearray()
    for block in layout:
        if isinstance(block, bytes):
            out += block
            continue
        for row in range(block.count):
            for file, first, length, stride in block.parts:
                out += read(first + row * stride, length, file)
    return bytes(out)
