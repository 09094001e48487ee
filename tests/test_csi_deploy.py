"""deploy/: every Kubernetes manifest parses and says what SPEC §15 asks of it (the CSIDriver's fields, the node
plugin's privileges, /dev/fuse, the kubelet's folder shared both ways, the registrar, a liveness probe; examples
that name only attributes and secret keys the plugin reads), ``kubectl kustomize`` renders them where kubectl is
installed (``apply --dry-run=client`` needs a cluster to ask), and the image's build file installs only what the
project installs elsewhere too."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from stfs.csi import DEFAULT_STATE_DIR, DRIVER_NAME
from stfs.csi.policy import DEFAULT_SOURCES
from stfs.csi.volumes import ATTRIBUTES, SECRETS
from stfs.options import size_bytes
from tests.helpers import run

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
MANIFESTS = sorted(KUBERNETES.rglob("*.yaml"))


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def only(kind: str, where: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    found = [doc for doc in (where if where is not None else documents()) if doc.get("kind") == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects in deploy/kubernetes"
    return found[0]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: str(path.relative_to(KUBERNETES)))
def test_every_manifest_parses_into_kubernetes_objects(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), path
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"]


def test_the_csidriver() -> None:
    driver = only("CSIDriver")
    assert driver["apiVersion"] == "storage.k8s.io/v1" and driver["metadata"]["name"] == DRIVER_NAME
    spec = driver["spec"]
    assert spec["attachRequired"] is False
    assert spec["podInfoOnMount"] is True
    assert spec["requiresRepublish"] is True
    assert sorted(spec["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]


def test_the_node_plugin() -> None:
    daemonset = only("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert (
        daemonset["spec"]["selector"]["matchLabels"].items()
        <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    )
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    containers = {container["name"]: container for container in pod["containers"]}
    plugin = containers["stfs"]
    assert plugin["securityContext"]["privileged"] is True
    assert plugin["args"][0] == "csi"
    options = dict(arg.removeprefix("--").split("=", 1) for arg in plugin["args"][1:])
    assert options["node-id"] == "$(NODE_NAME)"
    assert options["state-dir"] == DEFAULT_STATE_DIR
    socket = options["endpoint"].removeprefix("unix://")
    mounts = {mount["mountPath"]: mount for mount in plugin["volumeMounts"]}
    assert volumes[mounts["/dev/fuse"]["name"]]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    kubelet = mounts["/var/lib/kubelet"]
    assert kubelet["mountPropagation"] == "Bidirectional"
    assert volumes[kubelet["name"]]["hostPath"]["path"] == "/var/lib/kubelet"
    assert volumes[mounts[DEFAULT_STATE_DIR]["name"]]["hostPath"]["path"] == DEFAULT_STATE_DIR  # survives restarts
    # the socket's folder is the kubelet's plugins/DRIVER folder, which the registrar names to the kubelet
    socket_folder = volumes[mounts[str(Path(socket).parent)]["name"]]["hostPath"]["path"]
    assert socket_folder == f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    registrar = containers["node-driver-registrar"]
    assert "sig-storage/csi-node-driver-registrar:" in registrar["image"]
    assert f"--kubelet-registration-path={socket_folder}/{Path(socket).name}" in registrar["args"]
    assert f"--csi-address={socket}" in registrar["args"]
    registration = {mount["mountPath"]: mount["name"] for mount in registrar["volumeMounts"]}["/registration"]
    assert volumes[registration]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    probe = containers["liveness-probe"]
    assert f"--csi-address={socket}" in probe["args"]
    port = next(arg.split("=")[1] for arg in probe["args"] if arg.startswith("--health-port="))
    assert plugin["livenessProbe"]["httpGet"]["path"] == "/healthz"
    named = {p["name"]: str(p["containerPort"]) for p in plugin["ports"]}
    assert named[plugin["livenessProbe"]["httpGet"]["port"]] == port
    assert pod["serviceAccountName"] == only("ServiceAccount")["metadata"]["name"]


def test_the_node_plugin_states_its_policy_and_a_memory_limit() -> None:
    """SPEC §15a: the sources allowed written out (not left to the defaults), no path on the node, each volume its
    own credentials, and a memory limit that holds at least one volume at the largest cache it allows."""
    pod = only("DaemonSet")["spec"]["template"]["spec"]
    plugin = {container["name"]: container for container in pod["containers"]}["stfs"]
    flags = [arg.removeprefix("--").split("=", 1) for arg in plugin["args"][1:]]
    assert sorted(value for key, value in flags if key == "allow-source") == sorted(DEFAULT_SOURCES)
    assert "allow-path" not in dict(flags) and "node-credentials" not in dict(flags)
    cap = size_bytes(dict(flags)["max-cache-size"])
    limit = plugin["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) << 30 >= 4 * (cap + (150 << 20))


def test_the_examples_name_what_the_plugin_reads() -> None:
    examples = [doc for path in sorted((KUBERNETES / "examples").glob("*.yaml"))
                for doc in yaml.safe_load_all(path.read_text())]  # fmt: skip
    secrets = {doc["metadata"]["name"]: doc for doc in examples if doc["kind"] == "Secret"}
    inline = [volume["csi"] for doc in examples if doc["kind"] == "Pod" for volume in doc["spec"]["volumes"]
              if "csi" in volume]  # fmt: skip
    persistent = [doc["spec"]["csi"] for doc in examples if doc["kind"] == "PersistentVolume"]
    assert inline and persistent
    assert any(volume["volumeAttributes"]["source"].startswith("hf://") for volume in inline)
    for volume in inline + persistent:
        assert volume["driver"] == DRIVER_NAME and volume["readOnly"] is True
        assert set(volume["volumeAttributes"]) <= set(ATTRIBUTES) and "source" in volume["volumeAttributes"]
        assert all(isinstance(value, str) for value in volume["volumeAttributes"].values())
        secret = secrets[volume["nodePublishSecretRef"]["name"]]
        assert set(secret["stringData"]) <= set(SECRETS)
    pv = only("PersistentVolume", examples)
    claim = only("PersistentVolumeClaim", examples)
    assert pv["spec"]["accessModes"] == ["ReadOnlyMany"] == claim["spec"]["accessModes"]
    assert claim["spec"]["volumeName"] == pv["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_renders_the_kustomization() -> None:
    rendered = run(["kubectl", "kustomize", str(KUBERNETES)])
    assert rendered.returncode == 0, rendered.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(rendered.stdout))
    assert kinds == ["CSIDriver", "DaemonSet", "ServiceAccount"]


# -- the image's build file ------------------------------------------------------------------------------------------


def instructions() -> list[tuple[str, str]]:
    """The Containerfile's instructions, ``(KEYWORD, arguments)``, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1] if " " in line else "") for line in lines]


def apt_packages(shell: str) -> set[str]:
    """The packages the ``apt-get install`` commands of a shell text name."""
    found: set[str] = set()
    for command in re.findall(r"apt-get install([^;&|\n]*)", re.sub(r"\\\n", " ", shell)):
        found |= {word for word in shlex.split(command, comments=True) if not word.startswith("-")}
    return found


def test_the_containerfile_installs_what_the_project_installs_elsewhere() -> None:
    steps = instructions()
    known = {"FROM", "RUN", "COPY", "WORKDIR", "ENTRYPOINT", "CMD", "ENV", "ARG", "LABEL"}
    assert {keyword for keyword, _ in steps} <= known
    bases = [arguments.split()[0] for keyword, arguments in steps if keyword == "FROM"]
    assert bases and all(re.fullmatch(r"(python:3\.\d+-slim-bookworm|debian:bookworm-slim)", base) for base in bases)
    installed = set().union(*(apt_packages(arguments) for keyword, arguments in steps if keyword == "RUN"))
    assert {"fuse3", "libfuse3-3"} <= installed
    assert installed <= apt_packages((ROOT / "scripts" / "setup.sh").read_text())
    # the wheel with the csi extra, whose requirements the test extra installs too
    assert any("[csi]" in arguments for keyword, arguments in steps if keyword == "RUN")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!\[ ]", requirement)[0] for requirement in extras["test"]}
    assert {re.split(r"[<>=!\[ ]", requirement)[0] for requirement in extras["csi"]} <= names
    entrypoint, command = (arguments for keyword, arguments in steps if keyword in ("ENTRYPOINT", "CMD"))
    assert yaml.safe_load(entrypoint) == ["stfs"] and yaml.safe_load(command)[0] == "csi"
