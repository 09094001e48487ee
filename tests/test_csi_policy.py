"""``stfs csi``'s operator rules (SPEC §15a) over the real gRPC socket with real mounts: which sources a pod creator
may name (``--allow-source``, ``--allow-path``: each refusal leaves no trace and sends no request, each allowance
mounts), whose credentials a volume's daemon has (its own secret's; the plugin's environment and home folder only
with ``--node-credentials``), what a refusal's message tells (the rule, never bytes read), ``--max-cache-size``, and
a plugin started from a folder holding a package named ``stfs``."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from stfs.csi.mounts import told
from stfs.csi.policy import Policy
from stfs.csi.volumes import Refused
from stfs.daemon import daemon_pid
from tests.helpers import run
from tests.models import rich_arrays, write_numpy
from tests.registry import oras, push
from tests.test_csi import (
    DEFAULT_SOURCES,
    LOOPBACK_HTTP,
    REPO,
    TOKEN,
    Plugin,
    assert_serves,
    mounts_under,
    refusal,
    start_plugin,  # noqa: F401 (the fixture, shared)
    target_of,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("require_fuse")]

StartPlugin = Callable[..., Plugin]
# What the plugin's own environment holds and no volume of another pod creator may use
PLUGIN_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_HOME", "DOCKER_CONFIG", "REGISTRY_AUTH_FILE",
               "XDG_RUNTIME_DIR", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")  # fmt: skip


def denied(plugin: Plugin, target: Path, source: str, flag: str, **kwargs: object) -> str:
    """Publish ``source``: PERMISSION_DENIED naming ``flag``, in one line, with no trace left: no target, no mount,
    no daemon (no process names the target), nothing in the state folder."""
    refused = refusal(lambda: plugin.publish(target, {"source": source}, **kwargs))  # type: ignore[arg-type]
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
    assert flag in refused.details() and "\n" not in refused.details()
    assert not target.exists() and mounts_under(target.parents[6]) == []  # the test's folder
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(target).encode() in cmdline(pid)]
    assert [path for path in plugin.state.rglob("*") if path.is_file()] == []
    return refused.details()


def cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def environ(target: Path) -> dict[str, str]:
    """The environment of the daemon serving ``target``."""
    pid = daemon_pid(str(target))
    assert pid is not None
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode("utf-8", "replace").partition("=")[::2] for pair in pairs if pair)


@pytest.fixture
def plugins(start_plugin: StartPlugin) -> StartPlugin:  # noqa: F811 (tests/test_csi.py's, shared)
    """``plugins(flags, environment=None, launcher=None, cwd=REPO) -> Plugin``, each stopped at teardown."""
    return start_plugin


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    return Path(write_numpy(str(folder / "model.safetensors"), rich_arrays()))


# -- which sources ---------------------------------------------------------------------------------------------------


def test_paths_on_the_node_need_allow_path(plugins: StartPlugin, model: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = Path(write_numpy(str(outside / "secret.safetensors"), rich_arrays(seed=3)))
    target = target_of(tmp_path)
    plugin = plugins([])  # the defaults: no path at all
    assert "--allow-path" in denied(plugin, target, str(model), "--allow-path")
    plugin.stop()
    allowed = model.parent
    link = tmp_path / "link-to-models"
    link.symlink_to(allowed)
    plugin = plugins([f"--allow-path={link}"])  # the folder allowed is resolved too
    for source in (
        str(secret),
        f"{allowed}/../outside/secret.safetensors",  # .. resolved
        str(outside),
        "/",
        "models/model.safetensors",  # not absolute
        f"file://{model}",
        f"oci:{outside}:latest",  # skopeo's spelling of a store at PATH
        f"{outside}:latest",
    ):
        denied(plugin, target, source, "--allow-path")
    (allowed / "escape.safetensors").symlink_to(secret)  # a link inside leading out
    denied(plugin, target, str(allowed / "escape.safetensors"), "--allow-path")
    # allowed: a path below, however spelt; files/ lists only what lies below the allowed folders
    (allowed / "inside.safetensors").symlink_to(model)
    for source in (str(model), f"{link}/model.safetensors", f"{outside}/../models/inside.safetensors"):
        plugin.publish(target, {"source": source})
        assert_serves(target, model)
        plugin.unpublish(target)
    plugin.publish(target, {"source": str(allowed)})
    listed = {path.name for path in (target / "files").iterdir()}
    assert listed == {"model.safetensors", "inside.safetensors"}  # not escape.safetensors
    plugin.unpublish(target)
    assert mounts_under(tmp_path) == []


def test_urls_need_allow_source_and_no_request_is_made(
    hub, nginx, plugins: StartPlugin, model: Path, tmp_path: Path
) -> None:
    data = model.read_bytes()
    http_source = nginx.put("model.safetensors", data)
    hub.publish_repo("org", "open", {"model.safetensors": data})
    hub.publish_repo("other", "open", {"model.safetensors": data})
    target = target_of(tmp_path)
    nginx.log.clear()
    hub.log.clear()
    plugin = plugins([])  # the defaults: hf, s3, oci, https; no plain http
    denied(plugin, target, http_source, "--allow-source")
    for source in ("gs://bucket/model.safetensors", "ftp://127.0.0.1/model.safetensors"):
        denied(plugin, target, source, "--allow-source")
    assert nginx.log.entries() == []
    plugin.publish(target, {"source": "hf://org/open"})  # allowed by default
    assert_serves(target, model)
    plugin.unpublish(target)
    plugin.stop()
    hub.log.clear()
    # patterns given replace the defaults; plain http where one names it
    plugin = plugins(["--allow-source=hf://org/*", f"--allow-source={LOOPBACK_HTTP}"])
    for source in ("hf://other/open", "hf://org-evil/x", "oci://127.0.0.1:5000/org/x:v1", "https://127.0.0.1/org/x"):
        details = denied(plugin, target, source, "--allow-source")
        assert "hf://org/*" in details
    assert hub.log.entries() == []  # nothing asked of the Hub for a refused source
    plugin.publish(target, {"source": http_source})
    assert_serves(target, model)
    plugin.unpublish(target)
    plugin.publish(target, {"source": "hf://org/open"})
    assert_serves(target, model)
    plugin.unpublish(target)


@pytest.mark.parametrize(
    ("patterns", "source", "allowed"),
    [
        (None, "hf://org/repo", True),
        (None, "HF://org/repo", True),  # the scheme read in lower case, as stfs reads it
        (None, "https://host/x.safetensors", True),
        (None, "http://host/x.safetensors", False),
        (None, "docker://registry.example.com/m:v1", True),  # docker:// is oci://
        (["oci://registry.example.com/*"], "docker://registry.example.com/m:v1", True),
        (["oci://registry.example.com/*"], "oci://registry.example.com.evil.test/m:v1", False),
        (["oci://registry.example.com/*"], "oci://evil.test/registry.example.com/m:v1", False),
        (["https://*.example.com/*"], "https://a.example.com/x", True),
        (["https://*.example.com/*"], "https://evil.test/.example.com/x", False),  # * does not span / in the host
        (["https://*.example.com/*"], "https://evil.test\\.example.com/x", False),  # nor a backslash
        (["https://models.example.com/*"], "https://models.example.com@evil.test/x", False),
        (["https://models.example.com/*"], "https://u:p@models.example.com/x", False),
        (["s3://models-*/*"], "s3://models-a/x/", True),
        (["s3://models-*/*"], "s3://other/models-a/x", False),
        (["http://127.0.0.1:*/*"], "http://127.0.0.1:8080/x", True),
        (["http://127.0.0.1:*/*"], "http://127.0.0.1.evil.test:80/x", False),
        (["*"], "https://host/x", True),  # a pattern without a scheme: any URL of the schemes but plain http
        (["*"], "http://host/x", False),
        (["http://*"], "http://host/x", True),
        (["http://*"], "https://host/x", False),
    ],
)
def test_patterns_match_the_whole_source_and_its_host(patterns: list[str] | None, source: str, allowed: bool) -> None:
    policy = Policy.of(patterns, [])
    if allowed:
        policy.check(source)
    else:
        with pytest.raises(Refused) as raised:
            policy.check(source)
        assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED and "--allow-source" in raised.value.message


def test_flags_that_are_not_a_policy_are_refused_at_start(tmp_path: Path) -> None:
    for flags in (["--allow-source=/models/*"], ["--allow-source=gs://*"], ["--allow-source=file://*"],
                  ["--allow-path=models"], ["--max-cache-size=lots"]):  # fmt: skip
        command = [sys.executable, "-m", "stfs", "csi", "--endpoint", f"unix://{tmp_path}/csi.sock", "--node-id", "n"]
        result = run([*command, "--state-dir", str(tmp_path / "state"), *flags], cwd=REPO)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, (flags, result.stderr)
        assert flags[0].split("=")[0] in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "csi.sock").exists()


# -- memory ----------------------------------------------------------------------------------------------------------


def test_max_cache_size_caps_a_volume(nginx, plugins: StartPlugin, model: Path, tmp_path: Path) -> None:
    source = nginx.put("model.safetensors", model.read_bytes())
    plugin = plugins([f"--allow-source={LOOPBACK_HTTP}", "--max-cache-size=64M"])
    target = target_of(tmp_path)
    refused = refusal(lambda: plugin.publish(target, {"source": source, "cacheSize": "65M"}))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-cache-size 64M" in refused.details()
    assert not target.exists() and nginx.log.entries() == []
    plugin.publish(target, {"source": source, "cacheSize": "64M"})
    assert_serves(target, model)
    plugin.unpublish(target)
    plugin.publish(target, {"source": source})  # no cacheSize: the cap, not stfs's 1G
    pid = daemon_pid(str(target))
    assert b"--cache-size\x0064M\x00" in cmdline(str(pid))
    plugin.unpublish(target)


# -- credentials -----------------------------------------------------------------------------------------------------


def plugin_credentials(tmp_path: Path, registry_host: str, user: str, password: str) -> dict[str, str]:
    """A plugin environment holding every kind of credential the node might: the Hub's token in the environment
    and in HF_HOME's token file, AWS keys, a Docker login in DOCKER_CONFIG, REGISTRY_AUTH_FILE and ~/.docker."""
    home = tmp_path / "plugin-home"
    login = {"auths": {registry_host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}
    for folder in (home / ".docker", home / ".cache" / "huggingface", home / "docker-config"):
        folder.mkdir(parents=True)
    for path in (home / ".docker" / "config.json", home / "docker-config" / "config.json", home / "auth.json"):
        path.write_text(json.dumps(login))
    (home / ".cache" / "huggingface" / "token").write_text(TOKEN)
    return {
        "HOME": str(home),
        "HF_TOKEN": TOKEN,
        "HF_HOME": str(home / ".cache" / "huggingface"),
        "AWS_ACCESS_KEY_ID": "AKIAPLUGINNODEKEY",
        "AWS_SECRET_ACCESS_KEY": "plugin-node-secret-key",
        "DOCKER_CONFIG": str(home / "docker-config"),
        "REGISTRY_AUTH_FILE": str(home / "auth.json"),
        "XDG_RUNTIME_DIR": str(home),
    }


def test_a_volume_gets_its_own_credentials_and_never_the_plugins(
    hub, token_registry, plugins: StartPlugin, model: Path, tmp_path: Path
) -> None:
    data = model.read_bytes()
    hub.publish_repo("org", "private", {"model.safetensors": data})
    hub.protect("org", "private", TOKEN)
    private = token_registry.repo("csi-own")
    push(token_registry.registry, private, "v1", oras({"model.safetensors": data}),
         credentials=token_registry.credentials)  # fmt: skip
    oci = f"oci://{token_registry.host}/{private}:v1"
    node = plugin_credentials(tmp_path, token_registry.host, token_registry.user, token_registry.password)
    plugin = plugins([f"--allow-path={tmp_path}"], node)
    hub_target, oci_target, local_target = (target_of(tmp_path, pod) for pod in ("hub", "oci", "local"))
    # no secret: anonymous, whatever the plugin holds
    refused = refusal(lambda: plugin.publish(hub_target, {"source": "hf://org/private"}))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    refused = refusal(lambda: plugin.publish(oci_target, {"source": oci}))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    assert str(tmp_path) not in refused.details() and "secret" in refused.details()  # no home folder named
    assert mounts_under(tmp_path) == []
    # a volume's daemon: none of the plugin's keys, a home of its own, no instance metadata, no implicit token
    plugin.publish(local_target, {"source": str(model)})
    seen = environ(local_target)
    assert not [key for key in PLUGIN_KEYS + ("HF_TOKEN",) if key in seen]
    assert seen["HOME"].startswith(str(plugin.state)) and seen["HOME"] != node["HOME"]
    assert seen["AWS_EC2_METADATA_DISABLED"] == "true" and seen["AWS_SKIP_SIGNATURE"] == "true"
    assert seen["HF_HUB_DISABLE_IMPLICIT_TOKEN"] == "1"
    assert seen["HF_ENDPOINT"] == hub.endpoint and seen["PATH"] == os.environ["PATH"]  # configuration stays
    assert not [value for value in node.values() if value in seen.values()]
    # its own secret: mounted, and the daemon has that and no more
    plugin.publish(hub_target, {"source": "hf://org/private"}, secrets={"HF_TOKEN": TOKEN})
    assert_serves(hub_target, model)
    seen = environ(hub_target)
    assert seen["HF_TOKEN"] == TOKEN and not [key for key in PLUGIN_KEYS if key in seen]
    login = {"username": token_registry.user, "password": token_registry.password}
    plugin.publish(oci_target, {"source": oci}, secrets=login)
    assert (oci_target / "files" / "model.safetensors").read_bytes() == data
    seen = environ(oci_target)  # its login in a file of its own (removed once mounted), the rest as before
    assert seen["REGISTRY_AUTH_FILE"].startswith(str(tmp_path / "plugin-tmp" / "stfs-csi-login-"))
    assert not [key for key in PLUGIN_KEYS if key in seen and seen[key] == node.get(key)]
    for target in (hub_target, oci_target, local_target):
        plugin.unpublish(target)
    assert list((plugin.state / "homes").iterdir()) == []  # each volume's home gone with it
    plugin.stop()
    # --node-credentials: the plugin's own credentials serve volumes without a secret
    plugin = plugins([f"--allow-path={tmp_path}", "--node-credentials"], node)
    plugin.publish(hub_target, {"source": "hf://org/private"})
    assert_serves(hub_target, model)
    plugin.publish(oci_target, {"source": oci})
    assert (oci_target / "files" / "model.safetensors").read_bytes() == data
    assert environ(oci_target)["DOCKER_CONFIG"] == node["DOCKER_CONFIG"]
    for target in (hub_target, oci_target):
        plugin.unpublish(target)
    assert mounts_under(tmp_path) == []


def test_the_token_file_in_the_plugins_home_is_not_a_volumes(
    hub, plugins: StartPlugin, model: Path, tmp_path: Path
) -> None:
    hub.publish_repo("org", "private", {"model.safetensors": model.read_bytes()})
    hub.protect("org", "private", TOKEN)
    node = plugin_credentials(tmp_path, "127.0.0.1:1", "u", "p")
    del node["HF_TOKEN"]  # the token in the file HF_HOME and HOME both lead to alone
    plugin = plugins([], node)
    target = target_of(tmp_path)
    refused = refusal(lambda: plugin.publish(target, {"source": "hf://org/private"}))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    assert mounts_under(tmp_path) == []


def test_s3_without_a_key_pair_goes_unsigned(s3, plugins: StartPlugin, model: Path, tmp_path: Path) -> None:
    bucket = s3.create_bucket("csi-private")
    s3.put_object(bucket, "model.safetensors", model.read_bytes())
    source = f"s3://{bucket}/model.safetensors"
    plugin = plugins([])  # the test's environment: moto's endpoint and keys that may read the bucket
    target = target_of(tmp_path)
    refused = refusal(lambda: plugin.publish(target, {"source": source}))  # unsigned: moto refuses it
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED and "403" in refused.details()
    keys = {name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    plugin.publish(target, {"source": source}, secrets=keys)  # the volume's own keys
    assert_serves(target, model)
    seen = environ(target)
    assert seen["AWS_ACCESS_KEY_ID"] == keys["AWS_ACCESS_KEY_ID"] and "AWS_SKIP_SIGNATURE" not in seen
    assert seen["AWS_ENDPOINT_URL"] == os.environ["AWS_ENDPOINT_URL"] and "AWS_SHARED_CREDENTIALS_FILE" not in seen
    plugin.unpublish(target)
    plugin.stop()
    plugin = plugins(["--node-credentials"])
    plugin.publish(target, {"source": source})  # the plugin's keys
    assert_serves(target, model)
    assert environ(target)["AWS_ACCESS_KEY_ID"] == keys["AWS_ACCESS_KEY_ID"]
    plugin.unpublish(target)


# -- what a refusal tells --------------------------------------------------------------------------------------------


TEXT = b"pa55word=hunter2;zqxj_vkwy_qpfm_xyzzy\n"  # no six of its bytes in a row are words of a message


def assert_tells_no_bytes(details: str) -> None:
    for start in range(len(TEXT) - 6):
        assert TEXT[start : start + 6].decode() not in details, details
    assert "first bytes" not in details and "b'" not in details


def test_a_refusal_names_the_rule_never_bytes_it_read(nginx, plugins: StartPlugin, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "config.safetensors").write_bytes(TEXT)  # a text file so named
    (folder / "notes").write_bytes(TEXT)  # of no format stfs knows
    remote = nginx.put("leak.safetensors", TEXT)
    plugin = plugins([f"--allow-path={folder}", f"--allow-source={LOOPBACK_HTTP}"])
    target = target_of(tmp_path)
    for source, rule in ((folder / "config.safetensors", "rule 2"), (folder / "notes", "not a model stfs reads"),
                         (remote, "rule 2")):  # fmt: skip
        refused = refusal(lambda s=source: plugin.publish(target, {"source": str(s)}))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        assert rule in refused.details() and str(source) in refused.details()
        assert_tells_no_bytes(refused.details())
    assert "hunter2" not in plugin.log.read_text()


def test_a_wrong_password_names_no_deleted_file(
    token_registry, plugins: StartPlugin, model: Path, tmp_path: Path
) -> None:
    private = token_registry.repo("csi-wrong")
    push(token_registry.registry, private, "v1", oras({"model.safetensors": model.read_bytes()}),
         credentials=token_registry.credentials)  # fmt: skip
    plugin = plugins([])
    target = target_of(tmp_path)
    secrets = {"username": token_registry.user, "password": "not-it"}
    refused = refusal(lambda: plugin.publish(target, {"source": f"oci://{token_registry.host}/{private}:v1"},
                                             secrets=secrets))  # fmt: skip
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    assert token_registry.user in refused.details() and "the volume's secret" in refused.details()
    assert "auth.json" not in refused.details() and "stfs-csi-login" not in refused.details()
    assert "not-it" not in refused.details()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("/m/a.safetensors: not a safetensors file: its first bytes are b'hello wo' (rule 2 (HeaderTooLarge): header "
         "length 8031924123371070824 exceeds the limit of 100000000)",
         "/m/a.safetensors: not a safetensors file (rule 2 (HeaderTooLarge): header length exceeds the limit of "
         "100000000)"),
        ("/m/x: not a model stfs reads (a safetensors or GGUF file): its first bytes are b\"it's a \"",
         "/m/x: not a model stfs reads (a safetensors or GGUF file)"),
        ("/m/a.npy: does not begin with \\x93NUMPY (its first bytes are b'\\x00abc')", "/m/a.npy: does not begin with "
         "\\x93NUMPY"),
        ("/m/a.gguf: rule 1 (InvalidMagic): the file starts with b'abcd', not b'GGUF'",
         "/m/a.gguf: rule 1 (InvalidMagic): the file starts with (bytes not shown), not (bytes not shown)"),
        ("/m/a.safetensors: rule 3 (InvalidHeaderLength): header length 8 runs past the end of the 10-byte file",
         "/m/a.safetensors: rule 3 (InvalidHeaderLength): header length 8 runs past the end of the 10-byte file"),
    ],
)  # fmt: skip
def test_told_keeps_the_rule_and_drops_the_bytes(line: str, said: str) -> None:
    assert told(line, None) == said


# -- starting ----------------------------------------------------------------------------------------------------


def test_a_folder_named_stfs_where_the_plugin_starts_changes_nothing(
    plugins: StartPlugin, model: Path, tmp_path: Path
) -> None:
    clone = tmp_path / "clone"
    (clone / "stfs").mkdir(parents=True)
    (clone / "stfs" / "__init__.py").write_text("raise ImportError('the clone was imported')\n")
    (clone / "stfs" / "__main__.py").write_text("raise SystemExit('the clone ran')\n")
    script = tmp_path / "bin" / "stfs"  # as pip installs the console script: its own folder first on sys.path
    script.parent.mkdir()
    script.write_text("import sys\nfrom stfs.cli import main\nsys.exit(main())\n")
    plugin = plugins(allowing_models(model), launcher=[sys.executable, str(script)], cwd=clone)
    target = target_of(tmp_path)
    plugin.publish(target, {"source": str(model)})
    assert_serves(target, model)
    plugin.unpublish(target)


def allowing_models(model: Path) -> list[str]:
    return [*(f"--allow-source={pattern}" for pattern in DEFAULT_SOURCES), f"--allow-path={model.parent}"]
