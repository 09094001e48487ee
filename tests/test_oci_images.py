"""Container images as filesystems (SPEC §14a): KServe modelcars built by Debian's buildah and copied by skopeo, layers
with whiteouts and links written by hand, gzip layers read at random against a real registry (bytes counted at its
blob CDN), stores whose one bad model is left out, and the names people type (``oci:PATH:REF``, ``docker://``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from stfs.sources import open_source
from stfs.sources.base import ByteSource
from tests.helpers import REPO, MountFn, on_a_terminal, run, stfs_command
from tests.images import image, layer_tar, modelcar, skopeo_copy, tools_found
from tests.models import rich_arrays, write_numpy
from tests.registry import Registry, push, write_oci_layout, write_ollama_models
from tests.test_fstab import wait_gone
from tests.test_oci import assert_same_tensors, gguf_bytes, repository_files

pytestmark = pytest.mark.timeout(180)
IN_CI = os.environ.get("CI") == "true"
MIB = 1 << 20


@dataclass(frozen=True)
class Modelcars:
    model: Path  # the model folder the images hold under /models
    layout: Path  # an OCI layout folder: "modelcar" (gzip layers), "raw" (buildah commit -D: uncompressed)
    files: dict[str, bytes]


@pytest.fixture(scope="session")
def modelcars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Modelcars]:
    """Two modelcars built once per session by buildah (vfs storage, as root): gzip layers and uncompressed."""
    if not tools_found():
        if IN_CI:
            pytest.fail("buildah or skopeo is missing in CI (or not root)")
        pytest.skip("buildah and skopeo are not installed here (bash scripts/setup.sh)")
    base = tmp_path_factory.mktemp("modelcars")
    files = repository_files(base / "model")
    layout = base / "layout"
    storage = base / "storage"
    modelcar(layout, base / "model", storage, "modelcar")
    modelcar(layout, base / "model", storage, "raw", compress=False)
    try:
        yield Modelcars(base / "model", layout, files)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def layer_types(layout: Path, ref: str) -> list[str]:
    index = json.loads((layout / "index.json").read_text())
    [entry] = [e for e in index["manifests"] if e["annotations"]["org.opencontainers.image.ref.name"] == ref]
    manifest = json.loads((layout / "blobs" / "sha256" / entry["digest"][7:]).read_text())
    return [layer["mediaType"] for layer in manifest["layers"]]


def assert_random_reads(path: Path, payload: bytes, seed: int, reads: int, longest: int = 600_000) -> None:
    """``reads`` reads of ``path`` at random offsets, of 1 to ``longest`` bytes, each the same bytes as ``payload``."""
    picks = random.Random(seed)
    with open(path, "rb") as stream:
        for _ in range(reads):
            offset, count = picks.randrange(len(payload)), picks.randrange(1, longest)
            stream.seek(offset)
            assert stream.read(count) == payload[offset : offset + count], (offset, count)


# -- modelcars built by the real tools ---------------------------------------------------------------------------------


def test_a_buildah_modelcar_mounts_from_its_layout_by_ref(modelcars: Modelcars, mount: MountFn) -> None:
    assert layer_types(modelcars.layout, "modelcar") == ["application/vnd.oci.image.layer.v1.tar+gzip"]
    assert layer_types(modelcars.layout, "raw") == ["application/vnd.oci.image.layer.v1.tar"]
    local = mount(str(modelcars.model))
    for source in (f"oci:{modelcars.layout}:modelcar", f"{modelcars.layout}:raw"):
        mnt = mount(source)
        assert_same_tensors(mnt, local)
        for name, data in modelcars.files.items():  # files/ is the image; the model is what /models holds
            assert Path(mnt, "files", "models", name).read_bytes() == data
    both = mount(str(modelcars.layout))  # the folder itself: each manifest a model named by its ref name
    assert sorted(os.listdir(both)) == ["files", "modelcar", "raw"]
    assert_same_tensors(str(Path(both, "raw")), local)


def test_a_modelcar_copied_by_skopeo_mounts_as_docker_and_oci(modelcars: Modelcars, registry, mount: MountFn) -> None:
    repo = registry.repo("modelcar")
    skopeo_copy(f"oci:{modelcars.layout}:modelcar", f"docker://{registry.host}/{repo}:v1")
    local = mount(str(modelcars.model))
    for source in (f"docker://{registry.host}/{repo}:v1", f"oci://{registry.host}/{repo}:v1"):
        mnt = mount(source)
        assert_same_tensors(mnt, local)
        assert Path(mnt, "files", "models", "config.json").read_bytes() == modelcars.files["config.json"]


def test_a_ref_not_in_the_layout_is_refused_listing_those_there(modelcars: Modelcars) -> None:
    result = stfs_command("info", f"oci:{modelcars.layout}:nope")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "'nope'" in line and "modelcar, raw" in line


# -- layers applied in order, by hand ----------------------------------------------------------------------------------


def image_layers(model: bytes) -> list[bytes]:
    """Two layers: the second removes a file (whiteout), empties a folder (opaque) and adds links."""
    lower = layer_tar(
        [
            ("etc", None),
            ("etc/hostname", b"box\n"),
            ("models", None),
            ("models/model.safetensors", model),
            ("models/gone.txt", b"removed by a whiteout"),
            ("models/old", None),
            ("models/old/stale.txt", b"emptied by an opaque whiteout"),
        ]
    )
    upper = layer_tar(
        [
            ("models/.wh.gone.txt", b""),
            ("models/old/.wh..wh..opq", b""),
            ("models/old/fresh.txt", b"after the opaque whiteout"),
            ("models/hard.safetensors", ("link", "models/model.safetensors")),
            ("models/alias.txt", ("symlink", "old/fresh.txt")),
            ("models/host.txt", ("symlink", "/etc/hostname")),  # absolute: the image's /etc, not the host's
            ("models/escape.txt", ("symlink", "../../../../../etc/shadow")),  # stops at the image's root: nothing
            ("models/etc", ("symlink", "../etc")),  # a folder through a link
            ("../outside.txt", b"a member that leaves the image"),
        ]
    )
    return [lower, upper]


@pytest.mark.parametrize(
    "compress,docker", [(True, False), (False, False), (True, True)], ids=["gzip", "tar", "docker"]
)
def test_whiteouts_opaque_folders_and_links(mount: MountFn, tmp_path: Path, compress: bool, docker: bool) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    layout = write_oci_layout(tmp_path / "layout", {"v1": image(image_layers(model), compress, docker)})
    mnt = mount(str(layout))
    files = Path(mnt, "files")
    found = sorted(str(path.relative_to(files)) for path in files.rglob("*") if path.is_file())
    assert found == [  # files/ is the whole image
        "etc/hostname",
        "models/alias.txt",
        "models/etc/hostname",
        "models/hard.safetensors",
        "models/host.txt",
        "models/model.safetensors",
        "models/old/fresh.txt",
    ]
    inside = files / "models"
    assert (inside / "model.safetensors").read_bytes() == model == (inside / "hard.safetensors").read_bytes()
    assert (inside / "alias.txt").read_bytes() == b"after the opaque whiteout"
    assert (inside / "host.txt").read_bytes() == (inside / "etc" / "hostname").read_bytes() == b"box\n"
    assert sorted(os.listdir(Path(mnt, "models"))) == ["hard", "model"]  # the two models of /models
    result = stfs_command("info", str(layout))
    assert result.returncode == 0, result.stderr
    warned = result.stderr
    assert "'../outside.txt'" in warned and "escape.txt" in warned and "inside the image" in warned


# -- gzip layers read at random ----------------------------------------------------------------------------------------


def test_a_gzip_layer_is_read_at_random_after_one_pass(
    blob_redirector, registry, mount: MountFn, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    payload = rng.integers(0, 256, 24 * MIB, dtype=np.uint8).tobytes()
    half = rng.standard_normal(3 * MIB).astype(np.float16)  # compressible a little, as weights are
    payload += half.tobytes()
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    layer = layer_tar(
        [("models/model.safetensors", (tmp_path / "model.safetensors").read_bytes()), ("models/blob.bin", payload)]
    )
    artifact = image([layer])
    [gz] = [d for d in artifact.manifest["layers"]]
    repo = registry.repo("gzip-random")
    push(registry, repo, "v1", artifact)
    cache = tmp_path / "cache"

    def fetched() -> int:
        return sum(len(r.body) for r in blob_redirector.cdn_requests() if gz["digest"][7:] in r.path)

    mnt = mount(f"oci://{blob_redirector.host}/{repo}:v1", options=[f"cache_dir={cache}"])
    after_pass = fetched()
    assert gz["size"] <= after_pass <= 1.1 * gz["size"] + MIB  # the one pass: the blob once
    assert_random_reads(Path(mnt, "files", "models", "blob.bin"), payload, seed=7, reads=200, longest=3 * MIB)
    assert fetched() <= 1.1 * gz["size"] + MIB  # reads come from the blocks the pass brought, not again
    kept = sorted(path.suffix for path in (cache / "gzip-index").iterdir())
    assert kept == [".index"]  # the member list and the zran index, in one file counted in --cache-dir-size
    index_size = sum(path.stat().st_size for path in (cache / "gzip-index").iterdir())
    assert index_size <= 0.015 * gz["size"]
    # a second mount with the same --cache-dir: none of the pass again
    before = fetched()
    again = mount(f"oci://{blob_redirector.host}/{repo}:v1", options=[f"cache_dir={cache}"])
    offset = len(payload) - 5 * MIB
    assert (
        Path(again, "files", "models", "blob.bin").read_bytes()[offset : offset + MIB] == payload[offset : offset + MIB]
    )
    assert fetched() - before <= 8 * MIB


def test_a_tensor_of_an_uncompressed_image_layer_costs_its_bytes(
    blob_redirector, registry, mount: MountFn, tmp_path: Path
) -> None:
    """An image of uncompressed tar layers (buildah's default) is indexed by Range at mount; a tensor read after that
    fetches ≤ 1.1× its bytes from the blob CDN (SPEC §14a Costs), the indexing reads counted apart."""
    rng = np.random.default_rng(12)
    arrays = {f"layer{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(8)}  # 4 MiB each
    write_numpy(str(tmp_path / "model.safetensors"), arrays)
    model = (tmp_path / "model.safetensors").read_bytes()
    base = layer_tar([("etc/", None), ("etc/os-release", b"ID=scratch\n"), ("models/", None)])
    artifact = image([base, layer_tar([("models/model.safetensors", model), ("models/config.json", b"{}")])], False)
    assert {d["mediaType"] for d in artifact.manifest["layers"]} == {"application/vnd.oci.image.layer.v1.tar"}
    repo = registry.repo("image-tar-cost")
    push(registry, repo, "v1", artifact)
    digests = [d["digest"][7:] for d in artifact.manifest["layers"]]

    def fetched() -> int:
        return sum(len(r.body) for r in blob_redirector.cdn_requests() if any(d in r.path for d in digests))

    mnt = mount(f"oci://{blob_redirector.host}/{repo}:v1")
    indexing = fetched()
    assert indexing <= 2 * MIB  # the tar headers and the safetensors header, by Range: no layer read whole
    time.sleep(0.5)  # settled: nothing fetched while nothing is read
    assert fetched() == indexing
    name = "layer4"
    with open(Path(mnt, "tensors", name), "rb") as stream:
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        data = stream.read()
    assert data == arrays[name].tobytes()
    assert fetched() - indexing <= 1.1 * len(data)


def test_info_pays_the_gzip_pass_with_progress_only_on_a_terminal(tmp_path: Path) -> None:
    """``stfs info`` on a gzip image makes the one pass (it needs the member list): its bar on a terminal's stderr, gone
    once done; nothing but the table when stderr is not a terminal."""
    payload = np.random.default_rng(13).integers(0, 256, 4 * MIB, dtype=np.uint8).tobytes()
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    tar = layer_tar([("models/blob.bin", payload), ("models/model.safetensors", model)])
    artifact = image([tar])
    [layer] = artifact.manifest["layers"]
    layout = write_oci_layout(tmp_path / "layout", {"v1": artifact})
    code, terminal, stdout = on_a_terminal("info", str(layout))
    assert code == 0 and "model.embed_tokens.weight" in stdout
    assert f"indexing gzip layer {layer['digest'][7:19]}".encode() in terminal and b"%" in terminal
    assert b"\r" in terminal  # a bar redrawn in place, not lines
    plain = stfs_command("info", str(layout))
    assert plain.returncode == 0 and plain.stdout == stdout
    assert plain.stderr == ""


def test_a_spoiled_index_in_the_cache_dir_is_said_and_made_again(tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    layout = write_oci_layout(tmp_path / "layout", {"v1": image([layer_tar([("models/model.safetensors", model)])])})
    cache = tmp_path / "cache"
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def mounted() -> str:
        result = stfs_command("mount", str(layout), str(mnt), "--cache-dir", str(cache))
        try:
            assert result.returncode == 0, result.stderr
            assert Path(mnt, "files", "models", "model.safetensors").read_bytes() == model
        finally:
            stfs_command("unmount", str(mnt))
        return result.stderr

    assert "gzip index" not in mounted()
    [index] = (cache / "gzip-index").glob("*.index")
    index.write_bytes(index.read_bytes()[:-50] + bytes(50))  # its zran index spoiled
    said = mounted()
    lines = [line for line in said.splitlines() if "gzip index" in line]
    assert len(lines) == 1, said
    line = lines[0]
    assert str(index) in line and "does not match" in line and "made again" in line
    assert "gzip index" not in mounted()


# -- stores of many models ---------------------------------------------------------------------------------------------


def test_a_store_leaves_out_the_model_it_cannot_read(mount: MountFn, tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    good = image([layer_tar([("models/model.safetensors", model)])])
    broken = image([layer_tar([("models/model.safetensors", model + b"x")])], compress=False)
    layout = write_oci_layout(tmp_path / "layout", {"good": good, "broken": broken})
    [missing] = [d for d in broken.manifest["layers"]]
    (layout / "blobs" / "sha256" / missing["digest"][7:]).unlink()
    result = stfs_command("info", str(layout))
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "left out" in line]
    assert str(layout / "blobs" / "sha256" / missing["digest"][7:]) in line
    mnt = mount(str(layout))
    assert Path(mnt, "files", "good", "models", "model.safetensors").read_bytes() == model  # the one model left
    # an Ollama models folder with one blob gone: the other model mounts, the warning names the blob file
    data = gguf_bytes(tmp_path)
    from tests.registry import ollama

    store = write_ollama_models(
        tmp_path / "ollama",
        {"registry.ollama.ai/library/a/1b": ollama(data), "registry.ollama.ai/library/b/1b": ollama(data + b"\0" * 32)},
    )
    blob = store / "blobs" / ("sha256-" + ollama(data + b"\0" * 32).layers[0]["digest"][7:])
    blob.unlink()
    result = stfs_command("info", str(store))
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "left out" in line]
    assert str(blob) in line


def test_docker_scheme_is_read_as_oci() -> None:
    from stfs.sources import named_source

    assert named_source("docker://127.0.0.1:5000/org/m:v1") == "oci://127.0.0.1:5000/org/m:v1"
    assert named_source("DOCKER://127.0.0.1:5000/m") == "oci://127.0.0.1:5000/m"


def test_open_source_reads_a_layout_ref_as_its_model(tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    artifact = image([layer_tar([("models/model.safetensors", model)])], compress=False)
    layout = write_oci_layout(tmp_path / "layout", {"a": artifact, "b": artifact})
    source, root = open_source(f"oci:{layout}:b")
    try:
        assert root == str(layout) and source.read(f"{layout}/models/model.safetensors", 0, 8) == model[:8]
    finally:
        source.close()
    assert run(["true"]).returncode == 0


# -- credential helpers ------------------------------------------------------------------------------------------------


def helper_script(folder: Path, name: str, body: str) -> None:
    """``docker-credential-NAME`` as a shell script on ``folder`` (put on PATH): ``body`` reads the server."""
    path = folder / f"docker-credential-{name}"
    path.write_text(f'#!/bin/sh\n[ "$1" = get ] || exit 3\nread server\n{body}\n')
    path.chmod(0o755)


def test_credential_helpers_run_as_docker_runs_them(registry, monkeypatch, mount: MountFn, tmp_path: Path) -> None:
    pytest.importorskip("bcrypt")
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    repo = registry.repo("helper")
    push(
        registry,
        repo,
        "v1",
        image([layer_tar([("models/model.safetensors", (tmp_path / "model.safetensors").read_bytes())])]),
    )
    basic = Registry(tmp_path / "basic", htpasswd={"reader": "H3lper-Secret-never-shown"}, storage=registry.storage)
    basic.start()
    try:
        bin_folder = tmp_path / "bin"
        bin_folder.mkdir()
        host = basic.host
        answer = '{"ServerURL":"%s","Username":"reader","Secret":"H3lper-Secret-never-shown"}'
        helper_script(bin_folder, "good", f'[ "$server" = "{host}" ] || exit 4\nprintf \'{answer % host}\'')
        helper_script(bin_folder, "broken", 'echo "secret-looking output H3lper" >&2; echo oops; exit 2')
        helper_script(bin_folder, "empty", "echo 'credentials not found in native keychain'; exit 1")
        monkeypatch.setenv("PATH", f"{bin_folder}:{os.environ['PATH']}")
        config = tmp_path / "docker"
        config.mkdir()
        monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        source = f"docker://{host}/{repo}:v1"
        (config / "config.json").write_text(json.dumps({"credsStore": "empty", "credHelpers": {host: "good"}}))
        mnt = mount(source)
        data = (tmp_path / "model.safetensors").read_bytes()
        assert Path(mnt, "files", "models", "model.safetensors").read_bytes() == data
        (config / "config.json").write_text(json.dumps({"credsStore": "broken"}))
        failed = stfs_command("info", source)
        assert failed.returncode == 1
        [line] = failed.stderr.strip().splitlines()
        assert "docker-credential-broken" in line and host in line and "H3lper" not in line and "oops" not in line
        (config / "config.json").write_text(json.dumps({"credsStore": "empty"}))
        nothing = stfs_command("info", source)
        assert nothing.returncode == 1 and "user and password" in nothing.stderr
        (config / "config.json").write_text(json.dumps({"credsStore": "missing"}))
        missing = stfs_command("info", source)
        assert missing.returncode == 1 and "docker-credential-missing" in missing.stderr
        assert "is not installed" in missing.stderr
        # an open registry needs no helper: one that fails is not even said
        (config / "config.json").write_text(json.dumps({"credsStore": "broken"}))
        assert stfs_command("info", f"oci://{registry.host}/{repo}:v1").returncode == 0
    finally:
        basic.stop()


# -- zstd layers -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", ["zstd-frames", "zstd"])
def test_zstd_layers_by_frame_or_whole(mount: MountFn, tmp_path: Path, compress: str) -> None:
    rng = np.random.default_rng(9)
    payload = rng.standard_normal(9 * MIB).astype(np.float16).tobytes()  # 18 MiB: one frame of it is too large
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    tar = layer_tar([("models/model.safetensors", model), ("models/blob.bin", payload)])
    layout = write_oci_layout(tmp_path / "layout", {"v1": image([tar], compress)})
    mnt = mount(str(layout), options=[f"cache_dir={tmp_path / 'cache'}"])
    assert_random_reads(Path(mnt, "files", "models", "blob.bin"), payload, seed=3, reads=50)
    assert Path(mnt, "files", "models", "model.safetensors").read_bytes() == model
    whole = list((tmp_path / "cache" / "zstd-whole").glob("*.tar"))
    assert len(whole) == (1 if compress == "zstd" else 0)  # one frame: its output kept whole; frames: their index
    assert len(list((tmp_path / "cache" / "zstd-index").glob("*.index"))) == (0 if compress == "zstd" else 1)
    if whole:  # a later open reads the kept output: no pass again (the file not made again, only its use noted)
        made = whole[0].stat()
        source, root = open_source(str(layout), cache_dir=str(tmp_path / "cache"))
        try:
            assert source.read(f"{root}/models/blob.bin", 1000, 5000) == payload[1000:6000]
        finally:
            source.close()
        used = whole[0].stat()
        assert used.st_ino == made.st_ino and used.st_mtime_ns > made.st_mtime_ns  # the same file, used
        assert not list(whole[0].parent.glob("*.tmp"))


def test_one_zstd_frame_is_read_once_into_memory_without_cache_dir(
    blob_redirector, registry, mount: MountFn, tmp_path: Path
) -> None:
    """One frame larger than a frame read at random (18 MiB), no ``--cache-dir``: the pass keeps the layer's output in
    memory; every file then reads byte for byte from it, none of the blob fetched again."""
    payload = np.random.default_rng(11).standard_normal(9 * MIB).astype(np.float16).tobytes()
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    tar = layer_tar([("models/model.safetensors", model), ("models/blob.bin", payload)])
    artifact = image([tar], "zstd")
    [layer] = artifact.manifest["layers"]
    repo = registry.repo("zstd-memory")
    push(registry, repo, "v1", artifact)

    def fetched() -> int:
        return sum(len(r.body) for r in blob_redirector.cdn_requests() if layer["digest"][7:] in r.path)

    mnt = mount(f"oci://{blob_redirector.host}/{repo}:v1", options=["cache_size=8M"])  # the blob's blocks not kept
    after_pass = fetched()
    assert layer["size"] <= after_pass <= 1.1 * layer["size"] + MIB  # the one pass: the blob once
    assert Path(mnt, "files", "models", "model.safetensors").read_bytes() == model
    assert Path(mnt, "files", "models", "blob.bin").read_bytes() == payload
    assert_same_tensors(mnt, mount(str(tmp_path / "model.safetensors")))
    assert_random_reads(Path(mnt, "files", "models", "blob.bin"), payload, seed=5, reads=30)
    assert fetched() == after_pass  # read from memory, not from the blob again


def test_a_large_zstd_frame_after_small_ones_keeps_the_whole_output(tmp_path: Path) -> None:
    """The output is spooled only from the first frame too large to enter; the small frames before it are then
    decompressed again into the kept output, which is the layer's whole tar, byte for byte."""
    payload = np.random.default_rng(4).integers(0, 256, 24 * MIB, dtype=np.uint8).tobytes()
    tar = layer_tar([("models/a.bin", payload[: 6 * MIB]), ("models/b.bin", payload[6 * MIB :])])
    layout = write_oci_layout(tmp_path / "layout", {"v1": image([tar], "zstd-mixed")})
    source, root = open_source(str(layout), cache_dir=str(tmp_path / "cache"))
    try:
        assert source.read(f"{root}/models/a.bin", 0, 6 * MIB) == payload[: 6 * MIB]
        assert source.read(f"{root}/models/b.bin", 0, 18 * MIB) == payload[6 * MIB :]
    finally:
        source.close()
    [whole] = (tmp_path / "cache" / "zstd-whole").glob("*.tar")
    assert whole.read_bytes() == tar


def test_the_pass_over_zstd_frames_writes_no_output_to_the_cache_dir(tmp_path: Path) -> None:
    """A layer of frames keeps only its frame index in ``--cache-dir``: its pass writes none of the output there
    (it did, as if the layer might be read whole, then deleted it). A daemon that may write files of 2 MiB at most
    (``RLIMIT_FSIZE``) reads the 24 MiB layer all the same."""
    payload = np.random.default_rng(6).integers(0, 256, 24 * MIB, dtype=np.uint8).tobytes()
    layout = write_oci_layout(
        tmp_path / "layout", {"v1": image([layer_tar([("models/b.bin", payload)])], "zstd-frames")}
    )
    script = (
        "import resource, sys; from stfs.sources import open_source\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))\n"
        "source, root = open_source(sys.argv[1], cache_dir=sys.argv[2])\n"
        "sys.stdout.buffer.write(source.read(root + '/models/b.bin', 20 << 20, 4096)); source.close()\n"
    )
    result = run([sys.executable, "-c", script, str(layout), str(tmp_path / "cache")], cwd=REPO, text=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert result.stdout == payload[20 * MIB : 20 * MIB + 4096]
    assert len(list((tmp_path / "cache" / "zstd-index").glob("*.index"))) == 1


def test_one_large_zstd_frame_without_room_is_refused_naming_cache_dir(monkeypatch, tmp_path: Path) -> None:
    from stfs import errors
    from stfs.sources import zstd_layer

    monkeypatch.setattr(zstd_layer, "MEMORY_MAX", 1 << 20)
    monkeypatch.setattr(zstd_layer, "FRAME_MAX", 1 << 20)
    payload = np.random.default_rng(1).integers(0, 256, 3 * MIB, dtype=np.uint8).tobytes()
    layout = write_oci_layout(tmp_path / "layout", {"v1": image([layer_tar([("models/b.bin", payload)])], "zstd")})
    with pytest.raises(errors.SourceError) as refused:
        open_source(str(layout))
    assert "--cache-dir" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(errors.SourceError) as refused:  # nor in a --cache-dir-size smaller than it
        open_source(str(layout), cache_dir=str(tmp_path / "cache"), cache_dir_size=2 * MIB)
    assert "--cache-dir-size (2 MiB)" in str(refused.value) and "\n" not in str(refused.value)
    assert set(kept_files(tmp_path / "cache")) == {".stfs-usage"}  # nothing left of what was written
    source, root = open_source(str(layout), cache_dir=str(tmp_path / "cache"))
    try:
        assert source.read(f"{root}/models/b.bin", MIB, 100) == payload[MIB : MIB + 100]
    finally:
        source.close()


@pytest.mark.parametrize("compressed", ["gzip", "zstd"])
def test_a_modelpack_compressed_tar_artifact_is_read(registry, mount: MountFn, tmp_path: Path, compressed: str) -> None:
    """ModelPack's ``….v1.tar+gzip`` and ``….v1.tar+zstd`` layers (one zstd frame each, as modctl writes them)."""
    from tests.registry import modelpack

    files = repository_files(tmp_path / "repo")
    repo = registry.repo(f"modelpack-{compressed}")
    artifact = modelpack(files, compressed=compressed)
    assert {layer["mediaType"].rsplit(".", 1)[-1] for layer in artifact.layers} == {f"tar+{compressed}"}
    push(registry, repo, "v1", artifact)
    mnt = mount(f"oci://{registry.host}/{repo}:v1")
    assert_same_tensors(mnt, mount(str(tmp_path / "repo")))
    for name, data in files.items():
        assert Path(mnt, "files", name).read_bytes() == data


# -- what compressed layers keep in --cache-dir, within --cache-dir-size -----------------------------------------------


def kept_files(cache: Path) -> dict[str, int]:
    """Every file stfs keeps in ``cache`` (its usage count aside), by path below it: its size."""
    return {str(p.relative_to(cache)): p.stat().st_size for p in cache.rglob("*") if p.is_file()} | {".stfs-usage": 0}


def counted(cache: Path) -> int:
    """The bytes the daemons sharing ``cache`` count in it."""
    return int((cache / ".stfs-usage").read_text())


def test_gzip_indexes_are_kept_within_the_cache_dir_size_oldest_deleted_first(tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    rng = np.random.default_rng(11)
    payloads = {name: rng.integers(0, 256, 10 * MIB, dtype=np.uint8).tobytes() for name in ("a", "b")}
    layers = {
        name: image([layer_tar([("models/model.safetensors", model), ("models/blob.bin", data)])])
        for name, data in payloads.items()
    }
    layout = write_oci_layout(tmp_path / "layout", layers)
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    mnt.mkdir()

    def mounted(name: str, bound: int) -> str:
        result = stfs_command(
            "mount", f"{layout}:{name}", str(mnt), "--cache-dir", str(cache), "--cache-dir-size", str(bound)
        )
        try:
            assert result.returncode == 0, result.stderr
            assert Path(mnt, "files", "models", "blob.bin").read_bytes() == payloads[name]
        finally:
            stfs_command("unmount", str(mnt))
        return result.stderr

    def index_of(name: str) -> str:
        return f"gzip-index/{layers[name].manifest['layers'][0]['digest'].replace(':', '-')}.index"

    mounted("a", 1 << 30)
    size = kept_files(cache)[index_of("a")]
    assert kept_files(cache) == {index_of("a"): size, ".stfs-usage": 0} and counted(cache) == size
    bound = size * 3 // 2  # room for one index, not two (b's is as large: as many restart points)
    mounted("b", bound)
    kept = kept_files(cache)
    assert set(kept) == {index_of("b"), ".stfs-usage"}, kept  # a's, the least recently used, deleted for b's
    assert sum(kept.values()) == counted(cache) <= bound and kept[index_of("b")] > bound - size
    said = mounted("a", bound)  # a's made again by its pass, its bytes right, nothing said of it
    assert "index" not in said and "warning" not in said.lower(), said
    assert set(kept_files(cache)) == {index_of("a"), ".stfs-usage"}
    assert sum(kept_files(cache).values()) == counted(cache) <= bound


def test_zstd_outputs_are_kept_within_the_cache_dir_size_and_never_deleted_while_open(
    monkeypatch, tmp_path: Path
) -> None:
    from stfs.sources import zstd_layer

    monkeypatch.setattr(zstd_layer, "FRAME_MAX", 1 << 20)  # 3 MiB in one frame: read whole, kept in zstd-whole/
    rng = np.random.default_rng(12)
    payloads = {name: rng.integers(0, 256, 3 * MIB, dtype=np.uint8).tobytes() for name in ("x", "y", "z")}
    layers = {name: image([layer_tar([("models/b.bin", data)])], "zstd") for name, data in payloads.items()}
    layout = write_oci_layout(tmp_path / "layout", layers)
    cache = tmp_path / "cache"
    bound = 7 * MIB  # two outputs of 3 MiB and a bit fit, three do not

    def output(name: str) -> str:
        return f"zstd-whole/{layers[name].manifest['layers'][0]['digest'].replace(':', '-')}.tar"

    def opened(name: str) -> tuple[ByteSource, str]:
        source, root = open_source(f"{layout}:{name}", cache_dir=str(cache), cache_dir_size=bound)
        assert source.read(f"{root}/models/b.bin", 1000, MIB) == payloads[name][1000 : 1000 + MIB]
        return source, root

    for name in ("x", "y", "x"):  # x, y kept; x used again (no pass: its output read), so y is the older
        opened(name)[0].close()
    assert set(kept_files(cache)) == {output("x"), output("y"), ".stfs-usage"}
    x, x_root = opened("x")
    try:
        z, _ = opened("z")  # room for z: y deleted, not x (used more recently, and open)
        try:
            assert set(kept_files(cache)) == {output("x"), output("z"), ".stfs-usage"}
            assert sum(kept_files(cache).values()) == counted(cache) <= bound
            opened("y")[0].close()  # made again; room for it would take x or z, both open: neither is deleted
            assert set(kept_files(cache)) == {output("x"), output("y"), output("z"), ".stfs-usage"}
            assert x.read(f"{x_root}/models/b.bin", 2 * MIB, 100) == payloads["x"][2 * MIB : 2 * MIB + 100]
        finally:
            z.close()
    finally:
        x.close()
    assert not [path for path in kept_files(cache) if path.endswith(".tmp")]


def test_a_zstd_frame_index_is_kept_and_a_later_mount_makes_no_pass(
    blob_redirector, registry, mount: MountFn, tmp_path: Path
) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    payload = np.random.default_rng(13).integers(0, 256, 64 * MIB, dtype=np.uint8).tobytes()
    artifact = image([layer_tar([("models/model.safetensors", model), ("models/blob.bin", payload)])], "zstd-frames")
    [layer] = artifact.manifest["layers"]
    repo = registry.repo("zstd-frames")
    push(registry, repo, "v1", artifact)
    cache = tmp_path / "cache"
    source = f"oci://{blob_redirector.host}/{repo}:v1"

    def fetched() -> int:
        return sum(len(r.body) for r in blob_redirector.cdn_requests() if layer["digest"][7:] in r.path)

    first = mount(source, options=[f"cache_dir={cache}"])
    assert fetched() >= layer["size"]  # the pass: the blob once
    assert Path(first, "files", "models", "blob.bin").read_bytes()[-MIB:] == payload[-MIB:]
    [index] = (cache / "zstd-index").glob("*.index")
    assert not (cache / "zstd-whole").exists() or not list((cache / "zstd-whole").iterdir())
    daemon = int(os.getxattr(first, "user.stfs.pid"))
    assert stfs_command("unmount", first).returncode == 0  # its daemon done writing blocks to --cache-dir, then:
    assert wait_gone(daemon)
    for folder in cache.iterdir():  # the blob's blocks gone, as --cache-dir-size deletes them: only the index left
        if folder.is_dir() and folder.name != "zstd-index":
            shutil.rmtree(folder)
    (cache / ".stfs-usage").unlink()  # counted again from what is there
    before = fetched()
    again = mount(source, options=[f"cache_dir={cache}"])
    offset = 12 * MIB + 12345
    with open(Path(again, "files", "models", "blob.bin"), "rb") as stream:
        stream.seek(offset)
        assert stream.read(MIB) == payload[offset : offset + MIB]
    assert Path(again, "files", "models", "model.safetensors").read_bytes() == model
    # the blocks of the frames read and the readahead after them (two blocks of 8 MiB): no pass, the blob once
    assert fetched() - before <= layer["size"] // 2
