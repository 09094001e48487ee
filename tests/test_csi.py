"""``stfs csi`` (SPEC §15) driven as the kubelet drives a node plugin: a real plugin process on a unix socket, called
over gRPC with the generated stubs, making real mounts of real models (local, the Hub's shape on nginx, a registry
with token auth); then the plugin killed and restarted, and a mount's daemon killed and the volume republished."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import stfs
from stfs.csi import DRIVER_NAME, csi_pb2, csi_pb2_grpc
from stfs.csi.mounts import status_of
from stfs.daemon import daemon_pid, is_dead_mount, unescape_mountinfo, unmount
from tests.helpers import read_cold, run, tensor_path
from tests.models import rich_arrays, tensor_bytes, write_numpy
from tests.registry import oras, push

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("require_fuse")]

REPO = Path(__file__).resolve().parent.parent
NODE = "node-a"
Mode = csi_pb2.VolumeCapability.AccessMode
TOKEN = "hf_csiSecretToken0123456789"


class Plugin:
    """``stfs csi`` as a child process on a socket in ``folder``, its state in ``state``, with ``flags`` (its policy);
    started by ``launcher`` (``python -m stfs`` by default) in ``cwd``; the kubelet's calls."""

    def __init__(
        self,
        folder: Path,
        state: Path,
        environment: dict[str, str],
        flags: list[str] | None = None,
        launcher: list[str] | None = None,
        cwd: Path = REPO,
    ) -> None:
        self.folder = folder
        self.socket = folder / "csi.sock"
        self.state = state
        self.log = folder / "plugin.log"
        self.environment = environment
        self.flags = flags or []
        self.launcher = launcher or [sys.executable, "-m", "stfs"]
        self.cwd = cwd
        self.process: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> Plugin:
        command = [*self.launcher, "csi", "--endpoint", f"unix://{self.socket}"]
        command += ["--node-id", NODE, "--state-dir", str(self.state), *self.flags]
        with open(self.log, "a") as output:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, cwd=self.cwd, env=self.environment
            )
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        try:
            grpc.channel_ready_future(self.channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            self.stop()
            pytest.fail(f"stfs csi did not answer: {self.log.read_text()}")
        return self

    def stop(self, how: int = signal.SIGTERM) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(how)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    def publish(
        self,
        target: Path | str,
        context: dict[str, str],
        volume_id: str = "vol-1",
        secrets: dict[str, str] | None = None,
        readonly: bool = True,
        mode: int = Mode.SINGLE_NODE_WRITER,
        capability: csi_pb2.VolumeCapability | None = None,
    ) -> csi_pb2.NodePublishVolumeResponse:
        if capability is None:
            capability = csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=Mode(mode=mode)
            )
        request = csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id,
            target_path=str(target),
            volume_capability=capability,
            readonly=readonly,
            volume_context=context,
            secrets=secrets or {},
        )
        return self.node.NodePublishVolume(request, timeout=120)

    def unpublish(self, target: Path | str, volume_id: str = "vol-1") -> csi_pb2.NodeUnpublishVolumeResponse:
        request = csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        return self.node.NodeUnpublishVolume(request, timeout=120)


# The policy the tests of SPEC §15 run under: the defaults, plain HTTP on the loopback host, and the test's folder
LOOPBACK_HTTP = "http://127.0.0.1:*/*"
DEFAULT_SOURCES = ["hf://*", "s3://*", "oci://*", "https://*"]


def allowing(tmp_path: Path) -> list[str]:
    flags = [f"--allow-source={pattern}" for pattern in [*DEFAULT_SOURCES, LOOPBACK_HTTP]]
    return [*flags, f"--allow-path={tmp_path}"]


@pytest.fixture
def start_plugin(tmp_path: Path) -> Iterator[Callable[..., Plugin]]:
    """``start_plugin(flags, environment=None, launcher=None, cwd=REPO) -> Plugin``: a plugin started with the test's
    environment (a remote fixture listed before it has set its variables) updated by ``environment``; its socket in
    a short folder (a unix socket's path has at most 107 bytes). Each stopped by its PID, and every mount left under
    ``tmp_path`` undone, at teardown."""
    started: list[Plugin] = []
    (tmp_path / "plugin-tmp").mkdir()

    def start(
        flags: list[str],
        environment: dict[str, str] | None = None,
        launcher: list[str] | None = None,
        cwd: Path = REPO,
    ) -> Plugin:
        folder = Path(tempfile.mkdtemp(prefix="stfs-csi-"))
        variables = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "plugin-tmp")}
        one = Plugin(folder, tmp_path / f"state{len(started) or ''}", {**variables, **(environment or {})}, flags,
                     launcher, cwd)  # fmt: skip
        started.append(one)
        return one.start()

    try:
        yield start
    finally:
        for one in started:
            one.stop()
            shutil.rmtree(one.folder, ignore_errors=True)
        for mountpoint in mounts_under(tmp_path):
            with contextlib.suppress(Exception):
                unmount(mountpoint, lazy=True)


@pytest.fixture
def plugin(start_plugin: Callable[..., Plugin], tmp_path: Path) -> Plugin:
    """A plugin allowing the test's folder, the default URL patterns and plain HTTP on 127.0.0.1."""
    return start_plugin(allowing(tmp_path))


def mounts_under(folder: Path) -> list[str]:
    """Mount points under ``folder`` in /proc/self/mountinfo, one per mount (a path twice if mounted twice)."""
    prefix = str(folder) + os.sep
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as stream:
        points = [unescape_mountinfo(line.split(" ")[4]) for line in stream]
    return [point for point in points if point.startswith(prefix)]


def refusal(call: object) -> grpc.RpcError:
    """The ``grpc.RpcError`` a call ends with (it must not succeed)."""
    with pytest.raises(grpc.RpcError) as raised:
        call()  # type: ignore[operator]
    return raised.value


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return Path(write_numpy(str(tmp_path / "model.safetensors"), rich_arrays()))


def target_of(tmp_path: Path, pod: str = "pod-1") -> Path:
    """Where the kubelet asks for a pod's volume: the folder above exists, ``mount`` is the plugin's to make."""
    volume = tmp_path / "kubelet" / "pods" / pod / "volumes" / "kubernetes.io~csi" / "model"
    volume.mkdir(parents=True, exist_ok=True)
    return volume / "mount"


def assert_serves(target: Path, model: Path) -> None:
    for name in rich_arrays():
        assert read_cold(tensor_path(str(target), name)) == tensor_bytes(str(model), name), name


# -- Identity, capabilities, what is not implemented -----------------------------------------------------------------


def test_identity_and_capabilities(plugin: Plugin) -> None:
    info = plugin.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert (info.name, info.vendor_version) == (DRIVER_NAME, stfs.__version__)
    assert not plugin.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities
    probe = plugin.identity.Probe(csi_pb2.ProbeRequest())
    assert probe.HasField("ready") and probe.ready.value
    controller = csi_pb2_grpc.ControllerStub(plugin.channel)
    assert not controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest()).capabilities
    assert not plugin.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities
    assert plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == NODE
    assert plugin.channel is not None
    for method in (
        "/csi.v1.Node/NodeStageVolume",
        "/csi.v1.Node/NodeGetVolumeStats",
        "/csi.v1.Controller/CreateVolume",
    ):
        call = plugin.channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
        assert refusal(lambda call=call: call(b"", timeout=30)).code() == grpc.StatusCode.UNIMPLEMENTED, method


# -- publish, republish, unpublish -----------------------------------------------------------------------------------


def test_publish_serves_the_model_and_unpublish_removes_it(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    context = {
        "source": str(model),
        "csi.storage.k8s.io/pod.name": "vllm-0",
        "csi.storage.k8s.io/pod.namespace": "default",
        "csi.storage.k8s.io/ephemeral": "true",
    }
    plugin.publish(target, context)
    assert os.path.ismount(target)
    assert_serves(target, model)
    with pytest.raises(OSError):  # read-only
        (target / "new").write_bytes(b"x")
    # the pod's processes are not root: allow_other, and the modes let anyone read (the folder handed over open, as
    # a container's bind mount does: pytest's folders above it are root's alone)
    folder = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        reader = run([*nobody, "cat", f"/dev/fd/{folder}/header.json"], pass_fds=(folder,))
    finally:
        os.close(folder)
    assert reader.returncode == 0 and reader.stdout == (target / "header.json").read_text(), reader.stderr
    plugin.publish(target, context)  # the kubelet's periodic republish: OK, no second mount
    assert mounts_under(tmp_path) == [str(target)]
    assert_serves(target, model)
    plugin.unpublish(target)
    assert mounts_under(tmp_path) == []
    assert not target.exists()
    assert list((tmp_path / "state" / "volumes").iterdir()) == []
    plugin.unpublish(target)  # not mounted (nor there): OK
    target.mkdir()
    plugin.unpublish(target)  # there, not mounted: OK, removed
    assert not target.exists()


def test_attributes_choose_views_layout_and_cache(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    context = {"source": str(model), "views": "npy, f32", "layout": "flat", "cacheSize": "64M", "timeout": "10"}
    plugin.publish(target, context, mode=Mode.MULTI_NODE_READER_ONLY, readonly=False)  # a ReadOnlyMany PV
    assert {"npy", "f32", "tensors", "files"} <= set(os.listdir(target))
    assert (target / "tensors" / "model.embed_tokens.weight").exists()  # flat
    assert (target / "npy" / "model.embed_tokens.weight.npy").exists()
    plugin.unpublish(target)


def test_another_volume_at_a_mounted_target_already_exists(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    plugin.publish(target, {"source": str(model)})
    other = Path(write_numpy(str(tmp_path / "other.safetensors"), rich_arrays(seed=1)))
    for volume_id, context in [("vol-1", {"source": str(other)}), ("vol-2", {"source": str(model)}),
                               ("vol-1", {"source": str(model), "views": "npy"})]:  # fmt: skip
        refused = refusal(lambda v=volume_id, c=context: plugin.publish(target, c, volume_id=v))
        assert refused.code() == grpc.StatusCode.ALREADY_EXISTS and str(target) in refused.details()
    assert mounts_under(tmp_path) == [str(target)]
    assert_serves(target, model)
    # the same volume at a second target (a PersistentVolume in two pods on the node): a mount of its own
    second = target_of(tmp_path, "pod-2")
    plugin.publish(second, {"source": str(model)})
    assert sorted(mounts_under(tmp_path)) == sorted([str(target), str(second)])
    plugin.unpublish(target)
    plugin.unpublish(second)
    assert mounts_under(tmp_path) == []


# -- refusals --------------------------------------------------------------------------------------------------------


def test_requests_stfs_cannot_publish_are_invalid(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    good = {"source": str(model)}

    def invalid(**kwargs: object) -> str:
        refused = refusal(lambda: plugin.publish(**{"target": target, "context": good, **kwargs}))  # type: ignore[arg-type]
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        return refused.details()

    assert "'modelSource'" in invalid(context={**good, "modelSource": "x"})
    assert "source" in invalid(context={"views": "npy"})
    assert "'tensorflow'" in invalid(context={**good, "views": "npy,tensorflow"})
    assert "layout" in invalid(context={**good, "layout": "deep"})
    assert "cacheSize" in invalid(context={**good, "cacheSize": "lots"})
    assert "timeout" in invalid(context={**good, "timeout": "-1"})
    assert "readOnly" in invalid(readonly=False)  # SINGLE_NODE_WRITER, readonly false: writes
    assert "readOnly" in invalid(readonly=False, mode=Mode.MULTI_NODE_MULTI_WRITER)
    assert "access mode" in invalid(mode=Mode.UNKNOWN)
    block = csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(), access_mode=Mode(mode=2))
    assert "block" in invalid(capability=block)
    flags = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(mount_flags=["rw"]), access_mode=Mode(mode=2)
    )
    assert "'rw'" in invalid(capability=flags)
    assert "volume_id" in invalid(volume_id="")
    assert "target_path" in invalid(target="")
    assert "'hf_token'" in invalid(secrets={"hf_token": TOKEN})
    assert "oci://" in invalid(secrets={"username": "u", "password": "p"})
    missing = csi_pb2.NodePublishVolumeRequest(
        volume_id="v", target_path=str(target), readonly=True, volume_context=good
    )
    refused = refusal(lambda: plugin.node.NodePublishVolume(missing, timeout=60))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "volume_capability" in refused.details()
    unpublish = csi_pb2.NodeUnpublishVolumeRequest(volume_id="", target_path=str(target))
    assert refusal(lambda: plugin.node.NodeUnpublishVolume(unpublish)).code() == grpc.StatusCode.INVALID_ARGUMENT
    unpublish = csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path="")
    assert refusal(lambda: plugin.node.NodeUnpublishVolume(unpublish)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert mounts_under(tmp_path) == [] and not target.exists()
    assert TOKEN not in plugin.log.read_text()


def test_a_source_stfs_refuses_is_invalid_with_its_line(plugin: Plugin, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # a header longer than the file
    for source in (tmp_path / "missing.safetensors", broken):
        refused = refusal(lambda s=source: plugin.publish(target, {"source": str(s)}))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        said = run([sys.executable, "-m", "stfs", "check", str(source)], cwd=REPO).stdout.strip()
        assert refused.details() in said and str(source) in refused.details()
        assert not target.exists()  # left as it was
    assert mounts_under(tmp_path) == []


def test_a_server_that_does_not_answer_is_unavailable(plugin: Plugin, tmp_path: Path) -> None:
    from tests.servers import free_port

    target = target_of(tmp_path)
    for source in (f"http://127.0.0.1:{free_port()}/model.safetensors", f"oci://127.0.0.1:{free_port()}/model:v1"):
        refused = refusal(lambda s=source: plugin.publish(target, {"source": s, "timeout": "2"}))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused.details()
        assert "127.0.0.1" in refused.details()


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("oci://r.example/m:v1: access denied (HTTP 403)", "PERMISSION_DENIED"),
        ("r.example: the registry needs credentials; none found for it in /x (docker login ...)", "UNAUTHENTICATED"),
        ("r.example: the registry refuses the credentials of user 'u' (/x/auth.json)", "UNAUTHENTICATED"),
        ("hf://org/repo: access denied (HTTP 401): a token is needed (HF_TOKEN)", "UNAUTHENTICATED"),
        ("http://h/m.safetensors: the server answered HTTP 503", "UNAVAILABLE"),
        ("oci://h/m:v1: the registry does not answer: the host name does not resolve", "UNAVAILABLE"),
        ("oci://h/m:v1: no tag v1 in h/m", "INVALID_ARGUMENT"),
        ("/m.safetensors: header length 8 runs past the end of the file", "INVALID_ARGUMENT"),
    ],
)
def test_refusals_map_to_the_status_the_kubelet_acts_on(message: str, code: str) -> None:
    assert status_of(message).name == code


# -- secrets: the Hub's token, a registry's login --------------------------------------------------------------------


def secret_places(plugin: Plugin, target: Path) -> list[bytes]:
    """What must never hold a secret: every process's command line, the plugin's log, the state folder (records and
    daemon logs), the mount's xattrs."""
    places = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as stream:
                places.append(stream.read())
    places.append(plugin.log.read_bytes())
    places += [path.read_bytes() for path in plugin.state.rglob("*") if path.is_file()]
    places.append(run(["getfattr", "-R", "-d", "-m", "-", str(target)], text=False).stdout)
    return places


def test_a_hub_token_reaches_the_daemon_and_nothing_else(hub, plugin: Plugin, model: Path, tmp_path: Path) -> None:
    hub.publish_repo("org", "private", {"model.safetensors": model.read_bytes(), "config.json": b"{}"})
    hub.protect("org", "private", TOKEN)
    target = target_of(tmp_path)
    refused = refusal(lambda: plugin.publish(target, {"source": "hf://org/private"}))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    plugin.publish(target, {"source": "hf://org/private", "views": "safetensors"}, secrets={"HF_TOKEN": TOKEN})
    assert_serves(target, model)
    assert (target / "files" / "config.json").read_bytes() == b"{}"
    pid = daemon_pid(str(target))
    assert pid is not None
    with open(f"/proc/{pid}/environ", "rb") as stream:
        assert f"HF_TOKEN={TOKEN}".encode() in stream.read().split(b"\0")  # where it is meant to be
    assert not [place for place in secret_places(plugin, target) if TOKEN.encode() in place]
    plugin.unpublish(target)


def test_a_registry_login_is_a_private_file_gone_once_mounted(
    token_registry, plugin: Plugin, model: Path, tmp_path: Path
) -> None:
    private = token_registry.repo("csi")
    push(token_registry.registry, private, "v1", oras({"model.safetensors": model.read_bytes()}),
         credentials=token_registry.credentials)  # fmt: skip
    source = f"oci://{token_registry.host}/{private}:v1"
    target = target_of(tmp_path)
    anonymous = refusal(lambda: plugin.publish(target, {"source": source}))
    assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED, anonymous.details()
    wrong = refusal(lambda: plugin.publish(target, {"source": source}, secrets={"username": token_registry.user,
                                                                                "password": "not-it"}))  # fmt: skip
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED and "not-it" not in wrong.details()
    login = {"username": token_registry.user, "password": token_registry.password}
    plugin.publish(target, {"source": source}, secrets=login)
    assert (target / "files" / "model.safetensors").read_bytes() == model.read_bytes()
    assert list((tmp_path / "plugin-tmp").iterdir()) == []  # the auth file and its folder: removed
    assert not [place for place in secret_places(plugin, target) if token_registry.password.encode() in place]
    plugin.unpublish(target)


# -- restarts --------------------------------------------------------------------------------------------------------


def test_a_restarted_plugin_unpublishes_what_it_published(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    plugin.publish(target, {"source": str(model)})
    plugin.stop(signal.SIGKILL)  # a crash: the socket file stays, the daemon serves on
    assert plugin.socket.exists()
    assert_serves(target, model)
    plugin.start()  # same state folder; the stale socket replaced
    plugin.publish(target, {"source": str(model)})  # the kubelet's republish: known, OK, no second mount
    assert mounts_under(tmp_path) == [str(target)]
    other = Path(write_numpy(str(tmp_path / "other.safetensors"), rich_arrays(seed=1)))
    assert refusal(lambda: plugin.publish(target, {"source": str(other)})).code() == grpc.StatusCode.ALREADY_EXISTS
    pid = daemon_pid(str(target))
    plugin.unpublish(target)
    assert mounts_under(tmp_path) == [] and not target.exists()
    assert list((tmp_path / "state" / "volumes").iterdir()) == []
    deadline = time.monotonic() + 30
    while pid is not None and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid is None or not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_republish_heals_a_mount_whose_daemon_died(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    plugin.publish(target, {"source": str(model)})
    pid = daemon_pid(str(target))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not is_dead_mount(str(target)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert is_dead_mount(str(target))  # "Transport endpoint is not connected"
    plugin.publish(target, {"source": str(model)})
    assert not is_dead_mount(str(target))
    assert mounts_under(tmp_path) == [str(target)]
    assert daemon_pid(str(target)) not in (None, pid)
    assert_serves(target, model)
    # and after a plugin restart too
    os.kill(daemon_pid(str(target)), signal.SIGKILL)  # type: ignore[arg-type]
    plugin.stop(signal.SIGKILL)
    plugin.start()
    deadline = time.monotonic() + 30
    while not is_dead_mount(str(target)) and time.monotonic() < deadline:
        time.sleep(0.1)
    plugin.publish(target, {"source": str(model)})
    assert_serves(target, model)
    assert mounts_under(tmp_path) == [str(target)]
    plugin.unpublish(target)
    assert mounts_under(tmp_path) == []


def test_unpublish_with_a_file_open_detaches_lazily(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    plugin.publish(target, {"source": str(model)})
    pid = daemon_pid(str(target))
    assert pid is not None
    name = next(iter(rich_arrays()))
    expected = tensor_bytes(str(model), name)
    with open(tensor_path(str(target), name), "rb") as held:  # a pod's reader still at work: the mount is busy
        plugin.unpublish(target)
        assert mounts_under(tmp_path) == [] and not target.exists()
        assert list((tmp_path / "state" / "volumes").iterdir()) == []
        assert held.read() == expected  # detached, not ended: the open file still reads
        assert running(pid)
    deadline = time.monotonic() + 30  # released: the daemon ends
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(pid)


def running(pid: int) -> bool:
    """Whether process ``pid`` is alive (a zombie, its parent not having reaped it yet, has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_mount_is_unpublished(plugin: Plugin, model: Path, tmp_path: Path) -> None:
    target = target_of(tmp_path)
    plugin.publish(target, {"source": str(model)})
    pid = daemon_pid(str(target))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not is_dead_mount(str(target)) and time.monotonic() < deadline:
        time.sleep(0.1)
    plugin.unpublish(target)
    assert mounts_under(tmp_path) == [] and not target.exists()


def test_the_command_refuses_an_endpoint_it_cannot_serve_in_one_line(tmp_path: Path) -> None:
    not_a_socket = tmp_path / "csi.sock"
    not_a_socket.write_text("a file")
    for endpoint in (f"unix://{not_a_socket}", "unix://relative/csi.sock"):
        command = [sys.executable, "-m", "stfs", "csi", "--endpoint", endpoint, "--node-id", NODE]
        result = run([*command, "--state-dir", str(tmp_path / "state")], cwd=REPO)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("stfs: ") and "Traceback" not in result.stderr
    assert not_a_socket.read_text() == "a file"
