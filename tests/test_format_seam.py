"""The format seam without traps (docs/architecture.md, "Adding a format"): what a format leaves out is derived, not
defaulted. A header says it holds gathered tensors because an entry is gathered; a header's format and its tensors'
xattr namespace are the ``Format`` that read it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stfs import formats
from stfs.formats import Format, Header, RangeFetcher, TensorEntry
from stfs.model import Model, Shard
from stfs.nodes import read_into
from stfs.sources import LocalFiles
from stfs.views import build_tree
from tests.broken_formats import registered
from tests.helpers import MountFn, refusal, stfs_command


@dataclass(frozen=True, slots=True)
class Transposed:
    """A 2-D float32 tensor stored in Fortran order at ``start`` of its file: gathered into C order."""

    start: int
    shape: tuple[int, int]

    @property
    def offset(self) -> int:
        return self.start

    @property
    def span(self) -> tuple[int, int]:
        return self.start, 4 * self.shape[0] * self.shape[1]

    def read_into(self, read: formats.base.Read, begin: int, view: memoryview) -> None:
        stored = np.frombuffer(read(*self.span), dtype=np.float32).reshape(self.shape, order="F")
        view[:] = np.ascontiguousarray(stored).tobytes()[begin : begin + len(view)]


@dataclass(frozen=True, slots=True)
class TransposedEntry(TensorEntry):
    transposed: Transposed | None = None

    @property
    def scattered(self) -> Transposed | None:
        return self.transposed


class Plain(Format):
    """A format as a newcomer writes it: ``Header`` and ``TensorEntry`` without ``format=`` or a namespace; its file is
    a Fortran-order float32 array of shape ``SHAPE`` after a 16-byte magic."""

    name = "plain"
    title = "plain"
    SHAPE = (3, 5)

    def sniff(self, head: bytes) -> bool:
        return head.startswith(b"PLAIN")

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        entry = TransposedEntry("w", "F32", self.SHAPE, 16, file_size, Transposed(16, self.SHAPE))
        return Header(path, file_size, mtime_ns, (entry,), {}, b"", data_start=0, json_made=b"{}")


def plain_file(tmp_path: Path) -> tuple[Path, np.ndarray]:
    array = np.arange(15, dtype=np.float32).reshape(Plain.SHAPE)
    path = tmp_path / "w.plain"
    path.write_bytes(b"PLAIN".ljust(16, b"\0") + np.asfortranarray(array).tobytes(order="F"))
    return path, array


def read_plain(path: Path) -> Header:
    data = path.read_bytes()
    with registered(Plain(), "plain", (".plain",)) as known:  # read_with reads only with a format of REGISTRY
        return formats.read_with(
            known, lambda offset, size: data[offset : offset + size], path=str(path), file_size=len(data)
        )


def test_a_header_holding_a_gathered_tensor_says_so_and_its_file_is_gathered_in_c_order(tmp_path: Path) -> None:
    path, array = plain_file(tmp_path)
    data = path.read_bytes()
    header = Plain().read_header(lambda offset, size: data[offset : offset + size], path=str(path), file_size=len(data))
    assert header.scattered  # derived from its entry, though the format never said it
    model = Model("", str(path), {}, (Shard(path.name, header),))
    tree = build_tree([model])
    node = tree.lookup("/tensors/w")
    assert node is not None and not hasattr(node, "children")
    source = LocalFiles()
    try:
        buffer = bytearray(node.size)  # type: ignore[union-attr]
        read_into(node, 0, memoryview(buffer), source.read_into)  # type: ignore[arg-type]
    finally:
        source.close()
    assert bytes(buffer) == array.tobytes()  # C order, not the file's Fortran-order bytes


def test_a_header_is_of_the_format_that_read_it_and_its_xattrs_are_named_after_it(tmp_path: Path) -> None:
    path, _ = plain_file(tmp_path)
    header = read_plain(path)
    assert header.format == "plain"
    model = Model("", str(path), {}, (Shard(path.name, header),))
    node = build_tree([model]).lookup("/tensors/w")
    from stfs.nodes import tensor_xattrs

    names = sorted(tensor_xattrs(node))  # type: ignore[arg-type]
    assert names == [f"user.plain.{name}" for name in ("dtype", "file", "name", "offset", "shape")]
    assert os.path.basename(tensor_xattrs(node)["user.plain.file"].decode()) == "w.plain"  # type: ignore[arg-type]


def test_the_zip_reader_is_every_formats_and_its_refusals_name_no_format(tmp_path: Path) -> None:
    """``formats.zip`` reads any zip (here one Python's zipfile wrote) by range, and refuses in neutral words that the
    calling format rewords; ``base.read_exact`` refuses a short file as ``errors.TruncatedFile``."""
    import zipfile

    from stfs import errors
    from stfs.formats import zip
    from stfs.formats.base import read_exact

    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("one.txt", b"first", compress_type=zipfile.ZIP_STORED)
        archive.writestr("two.txt", b"second" * 100, compress_type=zipfile.ZIP_DEFLATED)
    data = path.read_bytes()

    def read(offset: int, size: int) -> bytes:
        return data[offset : offset + size]

    assert zip.first_member(data[:64]) == "one.txt"
    entries, start = zip.directory(read, len(data), str(path))
    assert [entry.name for entry in entries] == ["one.txt", "two.txt"] and start < len(data)
    [(offset, first)] = zip.local_headers(read, read_many(read), entries[:1], [5], [len(data)], start, str(path))
    assert data[offset : offset + 5] == first == b"first"
    zip.check_stored(entries[0], str(path))
    try:
        zip.check_stored(entries[1], str(path))
    except zip.EntryNotStored as exc:
        assert "two.txt" in exc.message and "torch" not in exc.message.lower()
    else:
        raise AssertionError("a deflated entry is not stored")
    try:
        read_exact(read, len(data) - 4, 8, str(path))
    except errors.TruncatedFile as exc:
        assert str(path) in exc.message and "checkpoint" not in exc.message.lower()
    else:
        raise AssertionError("a short read")


def read_many(read: RangeFetcher) -> formats.base.ReadMany:
    return lambda ranges: [read(offset, size) for offset, size in ranges]


def test_a_file_its_format_refuses_beside_a_model_is_left_in_files_and_the_model_mounts(
    tmp_path: Path, mount: MountFn
) -> None:
    """One bad file does not fail a folder: it is named in a warning, stays in ``files/``, and the model that mounts
    is the mount's one model, at its root; a folder of refused files alone fails in one line."""
    from safetensors.numpy import save_file

    folder = tmp_path / "repo"
    folder.mkdir()
    save_file({"w": np.arange(3, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "broken.gguf").write_bytes(b"GGUF" + bytes(6))  # cut short inside its header
    mnt = mount(str(folder))
    assert Path(mnt, "tensors", "w").read_bytes() == np.arange(3, dtype=np.float32).tobytes()
    assert Path(mnt, "files", "broken.gguf").read_bytes() == (folder / "broken.gguf").read_bytes()
    info = stfs_command("info", "--json", str(folder))
    assert info.returncode == 0, info.stderr
    [warning] = info.stderr.strip().splitlines()
    assert "broken.gguf" in warning and "files/" in warning
    assert [model["name"] for model in json.loads(info.stdout)["models"]] == [""]

    (folder / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}")  # refused too: a header shorter than said
    result = refusal(folder, tmp_path)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert str(folder) in line and "Traceback" not in result.stderr
