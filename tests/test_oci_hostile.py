"""Hostile image layers (SPEC §14a): each gets one line or is served as its tar says, never harm: gzip bombs, members
that leave the image, a great many tiny members, truncated and corrupt deflate streams; and the fuzzer, briefly."""

from __future__ import annotations

import gzip
import io
import resource
import tarfile
import zlib
from pathlib import Path

import pytest

from stfs import errors
from stfs.sources import open_source
from stfs.sources.tar_index import MAX_MEMBERS
from tests.helpers import short_fuzz_run
from tests.images import LAYER_GZIP, image, layer_tar
from tests.models import rich_arrays, write_numpy
from tests.registry import Artifact, sha256_digest, write_oci_layout

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def model_bytes(folder: Path) -> bytes:
    write_numpy(str(folder / "model.safetensors"), rich_arrays())
    return (folder / "model.safetensors").read_bytes()


def raw_gzip_image(layer: bytes) -> Artifact:
    """An image whose one layer is ``layer`` as it is (already gzip'd, or broken)."""
    made = image([b""], compress=False)
    manifest = dict(made.manifest)
    manifest["layers"] = [{"mediaType": LAYER_GZIP, "digest": sha256_digest(layer), "size": len(layer)}]
    config = {k: v for k, v in made.blobs.items() if k == made.manifest["config"]["digest"]}
    return Artifact(manifest, made.media_type, {**config, sha256_digest(layer): layer})


def refusal(folder: Path, layer: bytes) -> str:
    """The one line refusing the layout whose one image layer is ``layer``."""
    layout = write_oci_layout(folder, {"v1": raw_gzip_image(layer)})
    with pytest.raises(errors.SourceError) as refused:
        source, _ = open_source(str(layout))
        source.close()
    text = str(refused.value)
    assert "\n" not in text and str(layout) in text
    return text


def zeros_gzip(count: int, before: bytes = b"") -> bytes:
    """``before`` then ``count`` zero bytes, gzip'd (a stream of zeros inflates about 1000 times)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [compressor.compress(before)]
    block = bytes(MIB)
    for _ in range(count // MIB):
        parts.append(compressor.compress(block))
    parts.append(compressor.flush())
    return b"".join(parts)


def test_a_gzip_bomb_is_refused_before_it_inflates(tmp_path: Path) -> None:
    # one member claiming 300 MiB of zeros: about 300 KB of gzip, past 256 times that (plus 64 MiB)
    header = tarfile.TarInfo("models/zeros.bin")
    header.size = 300 * MIB
    bomb = zeros_gzip(300 * MIB + 1024, header.tobuf(format=tarfile.PAX_FORMAT))
    assert len(bomb) < 1 * MIB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = refusal(tmp_path / "layout", bomb)
    assert "gzip bomb" in line
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: nothing inflated whole


def test_zeros_after_the_tar_are_bounded_too(tmp_path: Path) -> None:
    tar = layer_tar([("models/a.txt", b"a")])
    line = refusal(tmp_path / "layout", zeros_gzip(300 * MIB, tar))
    assert "inflates past" in line


def test_members_that_leave_the_image_are_left_out_with_a_line(tmp_path: Path) -> None:
    model = model_bytes(tmp_path)
    tar = layer_tar(
        [
            ("models/model.safetensors", model),
            ("../x", b"up"),
            ("/abs", b"absolute"),
            ("models/../../y", b"up again"),
            ("models/out", ("symlink", "/../../../../etc/passwd")),
            ("models/hard", ("link", "../../etc/passwd")),
        ]
    )
    many = layer_tar([(f"../many{number}", b"") for number in range(50)])
    layout = write_oci_layout(tmp_path / "layout", {"v1": image([tar, many])})
    source, root = open_source(str(layout))
    try:
        files = sorted(key[len(root) + 1 :] for key in source.walk(root))
        assert files == ["models/model.safetensors"]
        said = source.groups[root].warnings  # type: ignore[attr-defined]
        warned = " | ".join(said)
        for name in ("'../x'", "'/abs'", "'models/../../y'", "'models/hard'"):  # links are said last
            assert name in warned, (name, warned)
        assert len(said) == 21 and said[-1].endswith("35 more members or links left out likewise"), said
    finally:
        source.close()


def test_too_many_tiny_members_are_refused_in_one_line(monkeypatch, tmp_path: Path) -> None:
    """A layer of more members than the bound (200,000; lowered here so that the test is quick: Python's tarfile
    parses about 20,000 headers a second) is refused once past it: the list never grows further."""
    from stfs.sources import gzip_layer

    bound = 20_000
    assert MAX_MEMBERS == gzip_layer.MAX_MEMBERS == 200_000
    monkeypatch.setattr(gzip_layer, "MAX_MEMBERS", bound)
    out = io.BytesIO()
    info = tarfile.TarInfo("m")
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1, mtime=0) as stream:
        for number in range(bound * 3):
            info.name = f"models/{number}"
            stream.write(info.tobuf(format=tarfile.USTAR_FORMAT))
        stream.write(bytes(1024))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = refusal(tmp_path / "layout", out.getvalue())
    assert f"more than {bound} members" in line
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "crc"])
def test_a_broken_deflate_stream_is_one_line(tmp_path: Path, damage: str) -> None:
    tar = layer_tar([("models/model.safetensors", model_bytes(tmp_path)), ("models/pad.bin", bytes(range(256)) * 999)])
    data = bytearray(gzip.compress(tar, mtime=0))
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "corrupt":
        data[len(data) // 3 : len(data) // 3 + 64] = bytes(64)
    else:
        data[-8] ^= 0xFF  # the CRC-32 of the trailer
    line = refusal(tmp_path / "layout", bytes(data))
    assert "is not a tar stfs can read" in line


def test_the_fuzzer_finds_nothing_in_a_short_run(tmp_path: Path) -> None:
    assert "cases: " in short_fuzz_run("fuzz_gzip_tar.py", tmp_path, 8, 3)


def test_links_resolve_inside_the_image_and_loops_end() -> None:
    from stfs.sources.image import image_files
    from stfs.sources.mapped import Piece
    from stfs.sources.tar_index import Entry

    members = [
        Entry("models/sub/w.bin", "file", 0, 4),
        Entry("models/self", "symlink", target="self"),
        Entry("models/b", "symlink", target="c"),
        Entry("models/c", "symlink", target="b"),
        Entry("models/folder", "symlink", target="sub"),
        Entry("models/up", "symlink", target="../../../../models/sub/w.bin"),
        Entry("models/sub/back", "symlink", target=".."),  # a folder holding itself: a loop
        Entry("models/long", "symlink", target="a/" * 3000),
    ]
    said: list[str] = []
    layers = [("sha256:x", members, lambda entry: Piece("blob", entry.offset, entry.size))]
    files, models = image_files(layers, said.append)
    assert models == "models" and sorted(files) == ["models/folder/w.bin", "models/sub/w.bin", "models/up"]
    assert files["models/up"] == files["models/sub/w.bin"] == Piece("blob", 0, 4)
    for name in ("'models/self'", "'models/b'", "'models/c'", "'models/long'"):
        assert any(name in line and "names nothing" in line for line in said), (name, said)
    assert any("makes a loop" in line for line in said), said
    assert max(len(line) for line in said) < 400  # a long target is shown cut


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "garbage"])
def test_a_broken_zstd_stream_is_one_line(tmp_path: Path, damage: str) -> None:
    from tests.images import zstd_frames

    tar = layer_tar([("models/model.safetensors", model_bytes(tmp_path)), ("models/pad.bin", bytes(range(256)) * 999)])
    data = bytearray(zstd_frames(tar, 64 << 10))
    if damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "corrupt":
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(range(64))
    else:
        data += b"not zstd at all"
    made = image([b""], compress=False)
    manifest = dict(made.manifest)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": sha256_digest(bytes(data))}
    manifest["layers"] = [{**layer, "size": len(data)}]
    config = {made.manifest["config"]["digest"]: made.blobs[made.manifest["config"]["digest"]]}
    layout = write_oci_layout(
        tmp_path / "layout", {"v1": Artifact(manifest, made.media_type, {**config, layer["digest"]: bytes(data)})}
    )
    with pytest.raises(errors.SourceError) as refused:
        source, _ = open_source(str(layout))
        source.close()
    assert "\n" not in str(refused.value) and "is not a tar stfs can read" in str(refused.value)
