"""Models in OCI registries and local stores of that shape (SPEC §14), against a real registry (Debian's
docker-registry, CNCF distribution 2.8) on 127.0.0.1 and artifacts laid out as ModelPack, ORAS, Ollama and Docker
Model Runner lay them out (tests/registry.py)."""

from __future__ import annotations

import filecmp
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from stfs import errors
from stfs.daemon import daemon_pid
from stfs.sources import open_source
from stfs.sources.registry import DOCKER_HUB_API, parse_reference
from tests.helpers import MountFn, run, stfs_command
from tests.models import rich_arrays, sharded_arrays, write_numpy, write_sharded
from tests.registry import (
    Registry,
    docker_model_runner,
    long_name_tar,
    modelpack,
    ollama,
    oras,
    push,
    push_index,
    write_oci_layout,
    write_ollama_models,
)
from tests.servers import free_port
from tests.test_gguf_format import write as write_gguf

pytestmark = pytest.mark.timeout(180)


# -- what the tests push ---------------------------------------------------------------------------------------------


def repository_files(folder: Path) -> dict[str, bytes]:
    """A model repository: a two-shard safetensors set with its index, config.json and a README."""
    write_sharded(str(folder), sharded_arrays())
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (folder / "README.md").write_text("# toy\n")
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def gguf_bytes(folder: Path, seed: int = 0, quant: GGMLQuantizationType | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    tensors = {
        "token_embd.weight": (rng.standard_normal((16, 32)).astype(np.float32), None),
        "blk.0.attn_q.weight": (rng.standard_normal((32, 32)).astype(np.float16), None),
    }
    path = write_gguf(folder / f"model-{seed}.gguf", tensors, general__name="toy")
    return path.read_bytes()


def tensor_files(mnt: str) -> dict[str, bytes]:
    """Every file under ``MNT/tensors`` (relative path -> bytes)."""
    found = {}
    root = Path(mnt, "tensors")
    for path in sorted(root.rglob("*")):
        if path.is_file():
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def assert_same_tensors(mnt: str, reference: str) -> None:
    """The tensor files of two mounts are the same names with the same bytes (compared with cmp)."""
    ours, theirs = tensor_files(mnt), tensor_files(reference)
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        assert run(["cmp", str(Path(mnt, "tensors", name)), str(Path(reference, "tensors", name))]).returncode == 0


# -- references ------------------------------------------------------------------------------------------------------


def test_references_parse_as_docker_reads_them() -> None:
    local = parse_reference("oci://127.0.0.1:5000/org/model:v1")
    assert (local.repository, local.tag, local.digest, local.plain_http) == ("org/model", "v1", None, True)
    assert parse_reference("oci://localhost:5000/m").tag == "latest"
    hub = parse_reference("oci://docker.io/smollm2")
    assert (hub.repository, hub.api_host, hub.plain_http) == ("library/smollm2", DOCKER_HUB_API, False)
    assert hub.origin == f"https://{DOCKER_HUB_API}"
    assert parse_reference("oci://registry.example:5000/m", plain_http=True).origin == "http://registry.example:5000"
    digest = "sha256:" + "ab" * 32
    pinned = parse_reference(f"oci://ghcr.io/org/m@{digest}")
    assert (pinned.digest, pinned.tag, pinned.plain_http) == (digest, None, False)
    for bad in ("oci://host", "oci://host/Upper", "oci://host/m@sha256:12", "oci:///m", "oci://host/m:bad:tag!"):
        with pytest.raises(errors.SourceError) as refused:
            parse_reference(bad)
        assert "\n" not in str(refused.value) and bad in str(refused.value)


# -- each layout, mounted --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tar", [False, True], ids=["raw", "tar"])
def test_modelpack_sharded_model_mounts_with_exact_bytes(registry, mount: MountFn, tmp_path: Path, tar: bool) -> None:
    files = repository_files(tmp_path / "repo")
    repo = registry.repo("modelpack")
    digest = push(registry, repo, "v1", modelpack(files, tar=tar))
    mnt = mount(f"oci://{registry.host}/{repo}:v1")
    local = mount(str(tmp_path / "repo"))
    assert_same_tensors(mnt, local)
    for name, data in files.items():
        assert Path(mnt, "files", name).read_bytes() == data
    assert Path(mnt, "metadata", "oci.digest").read_text() == digest + "\n"
    assert Path(mnt, "metadata", "oci.reference").read_text() == f"oci://{registry.host}/{repo}:v1\n"
    assert Path(mnt, "header.json").read_bytes() == Path(local, "header.json").read_bytes()  # oci.* in metadata/ only
    file_attr = run(["getfattr", "--only-values", "-n", "user.safetensors.file", f"{mnt}/tensors/lm_head/weight"])
    assert file_attr.stdout == f"oci://{registry.host}/{repo}@{digest}/model-00002-of-00002.safetensors"


def test_oras_files_and_an_unpacked_folder(registry, mount: MountFn, tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    long_name, long_tar = long_name_tar(b"long name's bytes", "tokenizer/" + "x" * 120 + ".json")
    folder = {"vocab.txt": b"a\nb\n", "nested/merges.txt": b"#v\n"}
    artifact = oras({"model.safetensors": model}, folders={"tokenizer": folder}, folder_gzip=False)
    repo = registry.repo("oras")
    push(registry, repo, "v1", artifact)
    mnt = mount(f"oci://{registry.host}/{repo}:v1")
    local = mount(str(tmp_path / "model.safetensors"))
    assert_same_tensors(mnt, local)
    assert Path(mnt, "files", "model.safetensors").read_bytes() == model
    for name, data in folder.items():
        assert Path(mnt, "files", "tokenizer", name).read_bytes() == data
    # a member whose path needs PAX's long name, in a ModelPack tar layer
    pax = modelpack({"model.safetensors": model}, tar=True)
    repo2 = registry.repo("pax")
    layer = {"mediaType": "application/vnd.cncf.model.weight.v1.tar", "annotations": {}}
    from tests.registry import Artifact, sha256_digest

    manifest = dict(pax.manifest)
    manifest["layers"] = [*pax.manifest["layers"], {**layer, "digest": sha256_digest(long_tar), "size": len(long_tar)}]
    push(registry, repo2, "v1", Artifact(manifest, pax.media_type, {**pax.blobs, sha256_digest(long_tar): long_tar}))
    mnt2 = mount(f"oci://{registry.host}/{repo2}:v1")
    assert len(long_name) > 100
    assert Path(mnt2, "files", long_name).read_bytes() == b"long name's bytes"


def test_a_gzip_folder_layer_is_unpacked_and_bzip2_left_out(registry, mount: MountFn, tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    artifact = oras({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()}, folders={"t": {"a": b"1"}})
    repo = registry.repo("gz")
    push(registry, repo, "v1", artifact)
    mnt = mount(f"oci://{registry.host}/{repo}:v1")
    assert Path(mnt, "files", "t", "a").read_bytes() == b"1"  # the ORAS folder, a tar+gzip layer, read at random
    # a compression stfs does not read: that layer left out, in one line saying so
    from tests.registry import Artifact, sha256_digest

    manifest = dict(artifact.manifest)
    odd = b"BZh91AY&SY" + bytes(30)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+bzip2", "digest": sha256_digest(odd), "size": 30 + 10}
    layer["annotations"] = {"org.opencontainers.image.title": "u", "io.deis.oras.content.unpack": "true"}
    manifest["layers"] = [*artifact.manifest["layers"], layer]
    push(registry, repo, "v2", Artifact(manifest, artifact.media_type, {**artifact.blobs, sha256_digest(odd): odd}))
    out = tmp_path / "mnt"
    out.mkdir()
    result = stfs_command("mount", f"oci://{registry.host}/{repo}:v2", str(out))
    try:
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "bzip2" in line]
        assert len(warnings) == 1 and "left out" in warnings[0], result.stderr
        assert Path(out, "files", "t", "a").read_bytes() == b"1" and not Path(out, "files", "u").exists()
    finally:
        stfs_command("unmount", str(out))


@pytest.mark.parametrize("layout", ["ollama", "docker-model-runner"])
def test_gguf_artifacts_mount(registry, mount: MountFn, tmp_path: Path, layout: str) -> None:
    data = gguf_bytes(tmp_path)
    (tmp_path / "model.gguf").write_bytes(data)
    artifact = ollama(data, params={"temperature": 0.7}) if layout == "ollama" else docker_model_runner(gguf=data)
    repo = registry.repo(layout)
    push(registry, repo, "q8", artifact)
    mnt = mount(f"oci://{registry.host}/{repo}:q8")
    assert_same_tensors(mnt, mount(str(tmp_path / "model.gguf")))
    assert Path(mnt, "files", "model.gguf").read_bytes() == data
    names = sorted(path.name for path in Path(mnt, "files").rglob("*") if path.is_file())
    if layout == "ollama":  # template and params keep their blob names
        assert len([name for name in names if name.startswith("sha256-")]) >= 2


def test_a_pytorch_checkpoint_from_a_registry(registry, mount: MountFn, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "layer.bias": torch.ones(3)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    artifact = modelpack({"pytorch_model.bin": (tmp_path / "pytorch_model.bin").read_bytes()})
    repo = registry.repo("torch")
    push(registry, repo, "v1", artifact)
    mnt = mount(f"oci://{registry.host}/{repo}:v1")
    assert Path(mnt, "tensors", "layer", "weight").read_bytes() == state["layer.weight"].numpy().tobytes()
    assert Path(mnt, "tensors", "layer", "bias").read_bytes() == state["layer.bias"].numpy().tobytes()


# -- pinning, indexes ------------------------------------------------------------------------------------------------


def test_a_mount_stays_at_its_manifest_when_the_tag_moves(registry, mount: MountFn, tmp_path: Path) -> None:
    first = tmp_path / "a" / "model.safetensors"
    second = tmp_path / "b" / "model.safetensors"
    first.parent.mkdir()
    second.parent.mkdir()
    write_numpy(str(first), rich_arrays(1))
    write_numpy(str(second), rich_arrays(2))
    repo = registry.repo("moving")
    digest = push(registry, repo, "latest", oras({"model.safetensors": first.read_bytes()}))
    mnt = mount(f"oci://{registry.host}/{repo}")
    push(registry, repo, "latest", oras({"model.safetensors": second.read_bytes()}))
    assert Path(mnt, "files", "model.safetensors").read_bytes() == first.read_bytes()
    assert Path(mnt, "metadata", "oci.digest").read_text().strip() == digest
    by_digest = mount(f"oci://{registry.host}/{repo}@{digest}")
    assert filecmp.cmp(Path(by_digest, "files", "model.safetensors"), first, shallow=False)


def test_an_image_index_is_followed_or_refused(registry, tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    model = (tmp_path / "model.safetensors").read_bytes()
    one, other = oras({"model.safetensors": model}), oras({"model.safetensors": model, "x.txt": b"x"})
    repo = registry.repo("index")
    push_index(registry, repo, "one", [(one, {})])
    push_index(
        registry,
        repo,
        "model",
        [
            (one, {"artifactType": "application/vnd.cncf.model.manifest.v1+json"}),
            (other, {"platform": {"os": "linux", "architecture": "s390x"}}),
        ],
    )
    push_index(
        registry,
        repo,
        "none",
        [
            (one, {"platform": {"os": "linux", "architecture": "s390x"}}),
            (other, {"platform": {"os": "windows", "architecture": "arm"}}),
        ],
    )
    for tag in ("one", "model"):
        result = stfs_command("info", f"oci://{registry.host}/{repo}:{tag}", "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["models"][0]["metadata"]["oci.digest"] == one.digest
    refused = stfs_command("info", f"oci://{registry.host}/{repo}:none")
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert "\n" not in line and "2 manifests" in line and "linux/s390x" in line and "windows/arm" in line


# -- costs -----------------------------------------------------------------------------------------------------------


def test_info_reads_the_manifest_and_header_bytes_only(registry, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    write_numpy(str(tmp_path / "big.safetensors"), {"w": rng.standard_normal((512, 1024)).astype(np.float32)})
    data = (tmp_path / "big.safetensors").read_bytes()
    repo = registry.repo("cost")
    push(registry, repo, "v1", modelpack({"model.safetensors": data}))
    result = stfs_command("info", f"oci://{registry.host}/{repo}:v1", "--json")
    assert result.returncode == 0, result.stderr
    transfer = json.loads(result.stdout)["transfer"]
    assert transfer["bytes"] <= 100_000 < len(data)  # the first speculative read, never the data
    assert transfer["requests"] <= 4  # the manifest, the blob's place, the first read (a token where asked)


def test_bytes_fetched_for_a_whole_model_read(registry, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {f"t{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(6)}
    write_numpy(str(tmp_path / "model.safetensors"), arrays)
    repo = registry.repo("fetched")
    push(
        registry, repo, "v1", modelpack({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()}, tar=True)
    )
    source, key = open_source(f"oci://{registry.host}/{repo}:v1", mounting=True, cache_size=64 << 20)
    try:
        from stfs.model import resolve

        (model,) = resolve(key, source)
        read = 0
        for tensor in model.tensors:
            buffer = memoryview(bytearray(tensor.size))
            assert source.read_into(tensor.file, tensor.offset, buffer, (tensor.offset, tensor.offset + tensor.size))
            assert bytes(buffer) == arrays[tensor.name].tobytes()
            read += tensor.size
        assert source.transfer()["bytes"] <= 1.1 * read
    finally:
        source.close()


# -- auth, redirects -------------------------------------------------------------------------------------------------


def test_token_auth_public_private_and_bad_credentials(
    token_registry, registry_auth_file, monkeypatch, mount: MountFn, tmp_path: Path
) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    artifact = oras({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()})
    private = token_registry.repo("private")
    push(token_registry.registry, private, "v1", artifact, credentials=token_registry.credentials)
    push(token_registry.registry, token_registry.public_repo, "v1", artifact, credentials=token_registry.credentials)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "none.json"))
    host = token_registry.host
    public = stfs_command("info", f"oci://{host}/{token_registry.public_repo}:v1")
    assert public.returncode == 0, public.stderr
    anonymous = stfs_command("info", f"oci://{host}/{private}:v1")
    assert anonymous.returncode == 1 and host in anonymous.stderr and "credentials" in anonymous.stderr
    assert len(anonymous.stderr.strip().splitlines()) == 1
    wrong = registry_auth_file(host, token_registry.user, "not-the-password")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(wrong))
    refused = stfs_command("info", f"oci://{host}/{private}:v1")
    assert refused.returncode == 1 and host in refused.stderr and "not-the-password" not in refused.stderr
    good = registry_auth_file(host, token_registry.user, token_registry.password)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(good))
    mnt = mount(f"oci://{host}/{private}:v1")
    assert Path(mnt, "files", "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()
    secrets = [token_registry.password]
    with open(f"/proc/{daemon_pid(mnt)}/cmdline", "rb") as stream:
        assert not any(secret.encode() in stream.read() for secret in secrets)
    attrs = run(["getfattr", "-R", "-d", "-m", "-", mnt]).stdout
    assert not any(secret in attrs for secret in secrets)


def test_an_expired_token_is_renewed(token_registry, registry_auth_file, monkeypatch, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    arrays = {f"t{i}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(3)}
    write_numpy(str(tmp_path / "model.safetensors"), arrays)
    repo = token_registry.repo("renew")
    artifact = oras({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()})
    push(token_registry.registry, repo, "v1", artifact, credentials=token_registry.credentials)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(registry_auth_file(token_registry.host, *token_registry.credentials)))
    token_registry.issuer.expires_in = 2
    token_registry.issuer.clear()
    source, key = open_source(f"oci://{token_registry.host}/{repo}:v1", mounting=True)
    try:
        from stfs.model import resolve

        (model,) = resolve(key, source)
        for tensor in model.tensors:
            time.sleep(2.5)  # past the token's life: the next read needs a new one
            buffer = memoryview(bytearray(tensor.size))
            source.read_into(tensor.file, tensor.offset, buffer, (tensor.offset, tensor.offset + tensor.size))
            assert bytes(buffer) == arrays[tensor.name].tobytes()
    finally:
        source.close()
    assert token_registry.issuer.tokens_issued >= 3


def test_blob_redirects_keep_range_and_drop_the_token(
    token_registry, token_blob_redirector, registry_auth_file, monkeypatch, mount: MountFn, tmp_path: Path
) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    repo = token_registry.repo("redirected")
    artifact = modelpack({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()})
    push(token_registry.registry, repo, "v1", artifact, credentials=token_registry.credentials)
    monkeypatch.setenv(
        "REGISTRY_AUTH_FILE", str(registry_auth_file(token_blob_redirector.host, *token_registry.credentials))
    )
    mnt = mount(f"oci://{token_blob_redirector.host}/{repo}:v1")
    assert_same_tensors(mnt, mount(str(tmp_path / "model.safetensors")))
    seen = token_blob_redirector.cdn_requests()
    assert seen and all("authorization" not in request.headers for request in seen)
    assert all(request.headers.get("range") for request in seen if request.method == "GET")


# -- refusals --------------------------------------------------------------------------------------------------------


def test_refusals_are_one_line(registry, tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    repo = registry.repo("refusals")
    push(registry, repo, "v1", oras({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()}))
    from tests.registry import Artifact, sha256_digest

    only = oras({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()})
    odd = b"BZh91AY&SY" + bytes(30)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+bzip2", "digest": sha256_digest(odd), "size": 40}
    layer["annotations"] = {"org.opencontainers.image.title": "u", "io.deis.oras.content.unpack": "true"}
    push(
        registry,
        repo,
        "gz",
        Artifact({**only.manifest, "layers": [layer]}, only.media_type, {**only.blobs, sha256_digest(odd): odd}),
    )
    cases = {
        f"oci://{registry.host}/{repo}:nope": "no such tag 'nope'",
        f"oci://{registry.host}/nobody/here:v1": "or no such repository",
        f"oci://127.0.0.1:{free_port()}/m:v1": "does not answer",
        f"oci://{registry.host}/{repo}:gz": "no layer stfs can read",
    }
    for source, words in cases.items():
        result = stfs_command("info", source)
        assert result.returncode == 1, (source, result.stderr)
        assert (
            words in result.stderr and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
        )
        mnt = tmp_path / f"mnt-{abs(hash(source))}"
        mnt.mkdir()
        mounted = stfs_command("mount", source, str(mnt))
        assert mounted.returncode == 1 and not os.path.ismount(mnt)


def test_check_values_names_a_blob_whose_bytes_differ(registry, tmp_path: Path) -> None:
    # a model of its own: blobs are shared by digest across the session registry's repositories
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays(7), metadata={"spoiled": "yes"})
    data = (tmp_path / "model.safetensors").read_bytes()
    repo = registry.repo("corrupt")
    artifact = oras({"model.safetensors": data})
    push(registry, repo, "v1", artifact)
    ok = stfs_command("check", "--values", f"oci://{registry.host}/{repo}:v1")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    digest = artifact.layers[0]["digest"]
    stored = registry.blob_path(digest)
    spoiled = bytearray(stored.read_bytes())
    spoiled[-1] ^= 0x01  # the last byte of the last tensor: a value still, only the digest tells
    stored.write_bytes(bytes(spoiled))
    try:
        bad = stfs_command("check", "--values", f"oci://{registry.host}/{repo}:v1")
    finally:
        stored.write_bytes(data)
    assert bad.returncode == 1
    assert [line for line in bad.stdout.splitlines() if digest in line and "other bytes" in line]


def test_check_values_fetches_each_blob_once(blob_redirector, registry, tmp_path: Path) -> None:
    """``check --values`` takes an artifact blob's digest from the bytes its value check reads, and reads only the
    rest (a header, an integer tensor it skips) for the digest: a model larger than its block cache crosses the wire
    once, not twice (values, then digest). The digest still catches a changed byte (the test above)."""
    rng = np.random.default_rng(3)
    arrays = {
        "a.weight": rng.standard_normal(21 << 20, dtype=np.float32),  # 84 MiB
        "b.ids": rng.integers(0, 1 << 40, 2 << 20, dtype=np.int64),  # 16 MiB the value check does not read
        "c.weight": rng.standard_normal(16 << 20, dtype=np.float32),  # 64 MiB: the whole above the 128 MiB cache
    }
    write_numpy(str(tmp_path / "model.safetensors"), arrays)
    data = (tmp_path / "model.safetensors").read_bytes()
    repo = registry.repo("check-once")
    artifact = oras({"model.safetensors": data, "config.json": b'{"model_type": "none"}'})
    push(registry, repo, "v1", artifact)
    digests = {layer["digest"]: layer["size"] for layer in artifact.layers}
    result = stfs_command("check", "--values", f"oci://{blob_redirector.host}/{repo}:v1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "values checked" in result.stdout
    for digest, size in digests.items():
        fetched = sum(len(r.body) for r in blob_redirector.cdn_requests() if digest[7:] in r.path)
        assert size <= fetched <= size + 128 * 1024, (digest, size, fetched)  # the first read's 100 kB once more


# -- local stores ----------------------------------------------------------------------------------------------------


def test_an_oci_layout_folder(mount: MountFn, tmp_path: Path) -> None:
    files = repository_files(tmp_path / "repo")
    single = write_oci_layout(tmp_path / "one", {"v1": modelpack(files, tar=True)})
    mnt = mount(str(single))
    assert_same_tensors(mnt, mount(str(tmp_path / "repo")))
    assert Path(mnt, "files", "config.json").read_bytes() == files["config.json"]
    write_numpy(str(tmp_path / "m.safetensors"), rich_arrays())
    several = write_oci_layout(
        tmp_path / "several",
        {"v1": modelpack(files), "small": oras({"model.safetensors": (tmp_path / "m.safetensors").read_bytes()})},
    )
    both = mount(str(several))
    assert sorted(os.listdir(both)) == ["files", "small", "v1"]
    assert Path(both, "v1", "metadata", "oci.reference").read_text() == "v1\n"
    assert Path(both, "small", "tensors").is_dir()


def test_an_ollama_models_folder(mount: MountFn, tmp_path: Path) -> None:
    q8, q4 = gguf_bytes(tmp_path, 0), gguf_bytes(tmp_path, 1)
    store = write_ollama_models(
        tmp_path / "models",
        {
            "registry.ollama.ai/library/toy/q8": ollama(q8),
            "registry.ollama.ai/library/toy/q4": ollama(q4),
            "hf.co/org/other/latest": ollama(q8),
        },
    )
    mnt = mount(str(store))
    assert sorted(os.listdir(Path(mnt, "library"))) == ["toy:q4", "toy:q8"]
    assert Path(mnt, "hf.co", "org", "other:latest", "tensors").is_dir()
    (tmp_path / "q8.gguf").write_bytes(q8)
    assert_same_tensors(str(Path(mnt, "library", "toy:q8")), mount(str(tmp_path / "q8.gguf")))
    manifests = store / "manifests" / "registry.ollama.ai" / "library" / "toy"
    alone = write_ollama_models(tmp_path / "alone", {"registry.ollama.ai/library/toy/q4": ollama(q4)})
    assert os.listdir(Path(mount(str(alone)), "library")) == ["toy:q4"]  # named even alone: the next pull moves nothing
    one = mount(str(manifests / "q4"))
    assert Path(one, "files", "model.gguf").read_bytes() == q4
    differ = stfs_command("diff", "-q", str(manifests / "q8"), str(manifests / "q4"))
    assert differ.returncode == 1 and "~ token_embd.weight" in differ.stdout
    same = stfs_command(
        "diff", "-q", str(manifests / "q8"), str(store / "manifests" / "hf.co" / "org" / "other" / "latest")
    )
    assert same.returncode == 0, same.stdout + same.stderr
    blobs = stfs_command("info", str(store / "blobs"))
    assert blobs.returncode == 1 and f"mount {store}" in blobs.stderr
    (blob,) = [path for path in (store / "blobs").iterdir() if path.read_bytes() == q4]
    alone = stfs_command("info", str(blob))  # a blob file alone: recognised by its first bytes
    assert alone.returncode == 0 and "token_embd.weight" in alone.stdout, alone.stderr


def test_basic_auth_answers_the_challenge_with_the_auth_files_login(
    registry, registry_auth_file, monkeypatch, mount: MountFn, tmp_path: Path
) -> None:
    """A registry behind HTTP Basic (distribution's htpasswd), serving the session registry's storage."""
    pytest.importorskip("bcrypt")
    write_numpy(str(tmp_path / "model.safetensors"), rich_arrays())
    repo = registry.repo("basic")
    push(registry, repo, "v1", oras({"model.safetensors": (tmp_path / "model.safetensors").read_bytes()}))
    basic = Registry(tmp_path / "basic", htpasswd={"reader": "B4sic-Pa55-never-shown"}, storage=registry.storage)
    basic.start()
    try:
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "none.json"))
        anonymous = stfs_command("info", f"oci://{basic.host}/{repo}:v1")
        assert anonymous.returncode == 1 and "user and password" in anonymous.stderr and basic.host in anonymous.stderr
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(registry_auth_file(basic.host, "reader", "wrong-one")))
        wrong = stfs_command("info", f"oci://{basic.host}/{repo}:v1")
        assert wrong.returncode == 1 and "reader" in wrong.stderr and "wrong-one" not in wrong.stderr
        monkeypatch.setenv(
            "REGISTRY_AUTH_FILE", str(registry_auth_file(basic.host, "reader", "B4sic-Pa55-never-shown"))
        )
        mnt = mount(f"oci://{basic.host}/{repo}:v1")
        assert Path(mnt, "files", "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()
    finally:
        basic.stop()
