"""The HDF5 walk's loops in C (``stfs/formats/hdf5/_scan.c``: a version 1 object header's messages, a symbol table
node's entries) against the Python loops they stand for (``STFS_NATIVE=0``, as an install without a compiler runs):
the same header, metadata, warnings and refusals, byte for byte, for files h5py writes and for broken copies of them."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from stfs.errors import StfsError
from stfs.formats import named, read_with
from stfs.formats.hdf5 import objects
from stfs.formats.hdf5.messages import Link
from stfs.formats.hdf5.objects import Message
from tests.hdf5_files import WRITERS

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(objects.NATIVE is None, reason="stfs.formats.hdf5._scan is not built (no compiler)")


def _pread(fd: int, offset: int, size: int) -> bytes:
    return os.pread(fd, size, offset)


def verdicts(paths: list[str]) -> dict[str, list[object]]:
    """What stfs makes of each file: its header.json, metadata, warnings and tensors; or its refusal."""
    found: dict[str, list[object]] = {}
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            read = functools.partial(_pread, fd)
            header = read_with(named("hdf5"), read, path=path, file_size=os.fstat(fd).st_size)
            found[path] = [
                header.json_made.decode("utf-8", "surrogateescape"),
                sorted(header.metadata.items()),
                list(header.warnings),
                [repr(tensor) for tensor in header.tensors],
            ]
        except StfsError as error:
            found[path] = ["refused", type(error).__name__, str(error)]
        finally:
            os.close(fd)
    return found


def python_verdicts(paths: list[str]) -> dict[str, list[object]]:
    """``verdicts`` in a process that runs the Python loops (``STFS_NATIVE=0``)."""
    script = (
        "import json, sys\nfrom stfs.formats.hdf5 import objects\nassert objects.NATIVE is None\n"
        "from tests.test_hdf5_native import verdicts\nprint(json.dumps(verdicts(sys.argv[1:])))"
    )
    env = {**os.environ, "STFS_NATIVE": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, *paths], capture_output=True, text=True, env=env, cwd=REPO, timeout=100
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def keras2(path: Path) -> Path:
    """Weights laid out as Keras 2 and ``tf_model.h5`` do: a group per level, old-style (symbol tables), attributes
    on the file and on groups, a name with a dot in it."""
    rng = np.random.default_rng(52)
    with h5py.File(path, "w", libver="earliest") as file:
        file.attrs["keras_version"] = b"2.15.0"
        file.attrs["layer_names"] = [b"dense", b"dense_1"]
        for layer in range(3):
            group = file.create_group(f"model/layers/{layer}")
            group.attrs["weight_names"] = [b"kernel:0", b"bias:0"]
            group.create_dataset("kernel:0", data=rng.standard_normal((4, 3 + layer)).astype(np.float32))
            group.create_dataset("bias:0", data=rng.standard_normal(3 + layer).astype(np.float16))
        for i in range(40):  # a group of more than one symbol table node
            file.create_dataset(f"many/w.{i:02d}", data=np.arange(i + 1, dtype=np.int32))
    return path


def broken(source: Path, folder: Path, rng: random.Random, count: int) -> list[Path]:
    """``count`` copies of ``source``, each with a few bytes changed or its end cut."""
    data = source.read_bytes()
    made = []
    for i in range(count):
        out = bytearray(data)
        kind = rng.randrange(4)
        if kind == 0:
            del out[rng.randrange(64, len(out)) :]
        else:
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(out))
                out[at] = (0, 0xFF, out[at] ^ (1 << rng.randrange(8)), rng.randrange(256))[rng.randrange(4)]
        path = folder / f"{source.stem}-{i:03d}.h5"
        path.write_bytes(bytes(out))
        made.append(path)
    return made


def test_the_c_loops_read_as_the_python_ones(tmp_path: Path) -> None:
    seeds = [keras2(tmp_path / "keras2.h5")]
    seeds += [WRITERS[kind](tmp_path / f"{kind}.h5") for kind in ("earliest", "compact", "userblock", "latest")]
    # the local heap's names without their NULs: no name ends where an entry says it begins
    heap = bytearray(seeds[0].read_bytes())
    at = heap.index(b"HEAP")
    size, data = int.from_bytes(heap[at + 8 : at + 16], "little"), int.from_bytes(heap[at + 24 : at + 32], "little")
    heap[data : data + size] = heap[data : data + size].replace(b"\0", b"A")
    (tmp_path / "no-name-end.h5").write_bytes(bytes(heap))
    paths = [*seeds, tmp_path / "no-name-end.h5"]
    rng = random.Random(52)
    for seed in seeds:
        paths += broken(seed, tmp_path, rng, 60)
    names = [str(path) for path in paths]
    ours = json.loads(json.dumps(verdicts(names)))  # as the other process's come: lists, not tuples
    assert ours == python_verdicts(names)
    refused = [verdict for verdict in ours.values() if verdict[0] == "refused"]
    assert 20 < len(refused) < len(ours) - 20, "the broken copies exercise both verdicts"
    assert all(verdict[0] != "refused" for verdict in (ours[name] for name in names[: len(seeds)]))
    assert "no name ends at offset" in ours[str(tmp_path / "no-name-end.h5")][2]


def test_the_c_loops_check_what_they_are_given() -> None:
    native = objects.NATIVE
    assert native is not None
    header = bytes(16) + (0x11).to_bytes(2, "little") + (16).to_bytes(2, "little") + bytes(4) + bytes(range(16))
    messages, count = native.v1_messages(header, len(header), 1000, Message)
    assert (messages, count) == ([Message(0x11, 0, bytes(range(16)), 1024)], 1)
    assert type(messages[0]) is Message
    assert native.v1_messages(header, len(header) + 1, 1000, Message) is None  # past the bytes given
    assert native.v1_messages(header, len(header) - 1, 1000, Message) is None  # a message past its block
    assert native.v1_messages(header, len(header), 2**64 - 8, Message) is None  # an address past 64 bits
    continued = header[:16] + (0x10).to_bytes(2, "little") + header[18:]
    assert native.v1_messages(continued, len(continued), 1000, Message) is None
    with pytest.raises(TypeError):
        native.v1_messages(header, len(header), 1000, dict)
    names = b"a\0bc\0\xff\0"
    entry = (0).to_bytes(8, "little") + (7).to_bytes(8, "little") + bytes(24)
    second = (2).to_bytes(8, "little") + (9).to_bytes(8, "little") + bytes(24)
    third = (5).to_bytes(8, "little") + (11).to_bytes(8, "little") + bytes(24)
    links = native.symbol_entries(entry + second + third, 8, names, 1 << 16, Link)
    assert links == [Link("a", 7), Link("bc", 9), Link("\udcff", 11)]
    assert type(links[0]) is Link
    assert native.symbol_entries(second, 8, b"a\0bc", 1 << 16, Link) == 2  # no NUL after it
    assert native.symbol_entries(second, 8, names, 1, Link) == 2  # none within the longest name
    assert native.symbol_entries((2**64 - 1).to_bytes(8, "little") + bytes(32), 8, names, 1 << 16, Link) == 2**64 - 1
    with pytest.raises(ValueError):
        native.symbol_entries(entry[:-1], 8, names, 1 << 16, Link)


def test_a_group_table_is_read_in_c_through_the_readers_windows(tmp_path: Path) -> None:
    from stfs.formats.hdf5.io import Reader
    from stfs.formats.hdf5.messages import SYMBOL_TABLE
    from stfs.formats.hdf5.objects import read_object, read_superblock
    from stfs.formats.hdf5.rules import Hdf5Truncated

    native = objects.NATIVE
    assert native is not None
    path = keras2(tmp_path / "keras2.h5")
    data = path.read_bytes()

    def table(data: bytes, budget: int = 1 << 20) -> tuple[list[Link], int] | None:
        reader = Reader(lambda offset, size: data[offset : offset + size], str(path), 0, len(data))
        root = read_object(reader, read_superblock(reader).root)
        message = next(message.data for message in root if message.kind == SYMBOL_TABLE)
        return native.symbol_table(reader.window_for, reader.base, message, 8, 8, 1 << 16, Link, budget)

    whole = table(data)
    assert whole is not None
    links, steps = whole
    with h5py.File(path) as file:
        assert sorted(link.name for link in links) == sorted(file.keys())
        assert {link.address for link in links} == {h5py.h5o.get_info(file[name].id).addr for name in file}
    assert steps == 1 + len(links)
    # the walk's steps bound the links made (a leaf's children may all name one node): past its budget, Python's
    assert table(data, steps) == whole
    assert table(data, steps - 1) is None
    # a changed signature is handed back to Python, which says what is wrong
    reader = Reader(lambda offset, size: data[offset : offset + size], str(path), 0, len(data))
    message = next(m.data for m in read_object(reader, read_superblock(reader).root) if m.kind == SYMBOL_TABLE)
    for at in (int.from_bytes(message[8:16], "little"), int.from_bytes(message[:8], "little")):
        assert table(data[:at] + b"X" + data[at + 1 :]) is None
    # a file that ends inside a structure fails as Reader fails there, from inside the C loop
    cut = int.from_bytes(message[8:16], "little") + 4  # inside the local heap's header
    short = Reader(lambda offset, size: data[offset : min(offset + size, cut)], str(path), 0, len(data))  # sizes: 8
    with pytest.raises(Hdf5Truncated, match="the file ends at byte"):
        native.symbol_table(short.window_for, short.base, message, 8, 8, 1 << 16, Link, 1 << 20)
    # a lookup that hands over a window without the bytes asked for is refused, never read past
    with pytest.raises(ValueError):
        native.symbol_table(lambda address, least, what: (0, b"HEAP"), 0, message, 8, 8, 1 << 16, Link, 1 << 20)
    with pytest.raises(ValueError):
        native.symbol_table(lambda address, least, what: (address + 1, data), 0, message, 8, 8, 1 << 16, Link, 9)
